"""How the planner computes each term of a plan, in words: every plan carries this (``Plan.to_dict()["method"]``)
so that a reader of ``/plan`` or of a job's stored prediction can check the arithmetic without the code."""

from __future__ import annotations

METHOD = {
    "model_states": "per rank, each term whole or sharded as the stage's traits say; partitioned terms use Φ "
    "padded per bucket to a multiple of N",
    "offload": "host keeps fp32 master (4Φ/N), fp32 gradient shard (4Φ/N), Adam moments (8Φ/N)",
    "offload_params": "stage 3, nvme: each unit's compute-dtype shard (fp32: the master) in a page-rounded "
    "file (disk_bytes); params in memory is the swap's buffer pool, max(prefetch + 1, 2 with fp32 masters) "
    "× the largest file; construction holds the shards, an fp32 step one unit's master, a checkpoint all",
    "buffers": "larger of backward scratch (stages 2/3: the engine's bucket -- stage 3: unit -- "
    "scratch replayed on the profile's timeline, 2 in flight + 1 filling; on a CPU rank its pages appear "
    "as gradients are written; bound without a profile: the largest 3 buckets) and step scratch (one "
    "bucket's fp32 gradient at a time, the optimizer's temporaries: CUDA foreach Adam over one bucket, "
    "CPU Adam two of the largest piece)",
    "peak": "the largest part of the job, each part what is alive at its worst moment: construction "
    "(kept states without optimizer state + one bucket/unit of fp32 staging; an eager model first holds "
    "itself in fp32), forward (states + gathered units + forward activations), backward (states + "
    "gathered units + activations and scratch on one timeline), step (states + step scratch), checkpoint "
    "(+ the host copy of the shard, over the worst training part when saves precede the last step), "
    "resume (+ the checkpoint read into host memory); a CPU rank counts host and device together",
    "total": "the peak (the device's; a CPU rank's host and device together) + reserve",
    "gathered_units": "stage 3: the root unit (embeddings, tied head; kept gathered) + (prefetch+1) "
    "× the largest block (a child of a ModuleList), padded, compute dtype",
    "activations": "peak live tensor bytes over one micro-batch forward+backward (dispatch tracker; "
    "meta device at submit time, SDPA as flash attention)",
    "reserve": "5% of the other terms, + 512 MiB CUDA context on GPUs",
    "comm_time": "ring collectives: bytes × (N-1)/N / link bandwidth; fully exposed (no overlap)",
    "disk_time": "nvme: disk_read_bytes / rate + disk_write_bytes / rate per step, exposed; every file is "
    "written once, the optimizer's read once, stage 3's parameter files read by each micro-step's forward "
    "and backward (less the units kept gathered) and in fp32 by the step",
    "step_time": "compute + comm_time + disk_time, none overlapped (given compute_s); calibrated: each term at "
    "its measured rate, + the optimizer step (planner/step_time.py)",
    "fits": "total <= (1 - margin) × budget; a GPU rank's host peak must also fit (1 - margin) × host budget",
}
