"""Reading TensorBoard event files back in tests, independently of the exporter's writer.

A TFRecord reader (length, masked CRC-32C of it, the record, its masked CRC; a checksum that
does not match fails the test) and tensorboardX's ``Event`` proto.
"""

from __future__ import annotations

import struct
from collections import defaultdict
from pathlib import Path

import numpy as np
from tensorboardX.crc32c import crc32c
from tensorboardX.proto.event_pb2 import Event


def _masked(data: bytes) -> int:
    x = crc32c(data) & 0xFFFFFFFF
    return (((x >> 15) | (x << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_records(path: Path) -> list[bytes]:
    data, records, at = path.read_bytes(), [], 0
    while at < len(data):
        header = data[at:at + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[at + 8:at + 12])[0] == _masked(header), f"bad length CRC in {path}"
        body = data[at + 12:at + 12 + length]
        assert struct.unpack("<I", data[at + 12 + length:at + 16 + length])[0] == _masked(body), f"bad CRC in {path}"
        records.append(body)
        at += 16 + length
    return records


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] over every event file of the folder, in name order."""
    scalars: dict[str, list[tuple[int, float]]] = defaultdict(list)
    files = sorted(p for p in log_dir.iterdir() if "tfevents" in p.name)
    for path in files:
        events = [Event.FromString(record) for record in read_records(path)]
        assert events[0].file_version == "brain.Event:2"
        for event in events[1:]:
            for value in event.summary.value:
                scalars[value.tag].append((event.step, value.simple_value))
    return scalars


def f32(value: float) -> float:
    return float(np.float32(value))  # an event's simple_value is a float32


def rank_mean_loss(points) -> list[tuple[int, float]]:  # noqa: ANN001 - the SDK's MetricPoints
    """[(step, the ranks' mean loss as a float32)] of metric points of one attempt per step."""
    by_step: dict[int, list[float]] = defaultdict(list)
    for point in points:
        by_step[point.step].append(point.loss)
    return [(step, f32(sum(losses) / len(losses))) for step, losses in sorted(by_step.items())]
