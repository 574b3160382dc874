"""Issue 15, buffers like DDP: a BatchNorm CNN at stages 0-3 against torch DDP in the same world.

* bf16 trains at every stage (buffers stay fp32, BatchNorm runs; ``full_state_dict`` gives fp32);
* with ``broadcast_buffers=True`` (the default) the running statistics are identical on every
  rank after training and equal DDP's; fp32 parameters equal DDP's;
* ``broadcast_buffers=False`` keeps each rank's own statistics, as DDP(forward_sync_buffers=False);
* ``sync_batchnorm=True`` and ``nn.SyncBatchNorm.convert_sync_batchnorm`` match BatchNorm over the
  global batch in one process (what DDP + SyncBatchNorm computes; torch's own SyncBatchNorm
  refuses CPU tensors, so DDP cannot run it here).

One spawned world of N=2 runs every case.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from workers.zero.testing import spawn_world

N = 2
STEPS, MICRO, BATCH = 4, 2, 4
STAGES = (0, 1, 2, 3)


class BNNet(nn.Module):
    """conv + BatchNorm + relu + linear: the smallest model with running statistics."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


def make_net(seed: int) -> BNNet:
    torch.manual_seed(seed)
    return BNNet()


def batch(step: int, micro: int, rank: int):
    g = torch.Generator().manual_seed(7919 * step + 131 * micro + rank)
    x = torch.randn(BATCH, 3, 4, 4, generator=g) * (1 + rank) + rank  # ranks see different statistics
    return x, torch.randint(0, 5, (BATCH,), generator=g)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def train(rank: int, call):
    """STEPS steps of MICRO micro-batches, and an evaluation forward under no_grad after each."""
    losses = []
    for step in range(STEPS):
        for micro in range(MICRO):
            x, y = batch(step, micro, rank)
            loss = F.cross_entropy(call(x).float(), y) / MICRO
            call.step("backward", loss)
            losses.append(loss.item())
        call.step("step", None)
        with torch.no_grad():
            call.eval_forward(batch(step, 99, rank)[0])
    return losses


class _Engine:
    def __init__(self, engine):
        self.engine = engine

    def __call__(self, x):
        return self.engine(x)

    def eval_forward(self, x):
        self.engine.eval()
        self.engine(x)
        self.engine.train()

    def step(self, what, loss):
        if what == "backward":
            self.engine.backward(loss)
        else:
            self.engine.step()


class _Plain:
    """A DDP-wrapped model and its optimizer."""

    def __init__(self, model):
        self.model = model
        self.opt = optimizer([p for p in model.parameters()])

    def __call__(self, x):
        return self.model(x)

    def eval_forward(self, x):
        self.model.eval()
        self.model(x)
        self.model.train()

    def step(self, what, loss):
        if what == "backward":
            loss.backward()
        else:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)


def run_engine(rank: int, stage: int, precision: str, sync_bn: str | None = None, **cfg):
    from workers.zero import ZeroConfig, ZeroEngine

    model = make_net(rank)  # different on every rank: the engine broadcasts rank 0's
    if sync_bn == "convert":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if sync_bn == "option":
        cfg["sync_batchnorm"] = True
    config = ZeroConfig(stage=stage, precision=precision, bucket_mb=0.001, **cfg)
    engine = ZeroEngine(model, optimizer, config)
    wrapper = _Engine(engine)
    losses = train(rank, wrapper)
    return {"full": engine.full_state_dict(), "shard_buffers": engine.state_dict()["buffers"], "losses": losses,
            "control": engine.comm_volume()["control"]}


def run_ddp(rank: int, forward_sync_buffers: bool = True):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(make_net(0), forward_sync_buffers=forward_sync_buffers)
    wrapper = _Plain(ddp)
    losses = train(rank, wrapper)
    return {"sd": {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}, "losses": losses}


def run_global_batch(rank: int, world_size: int):
    """One process, plain BatchNorm over every rank's rows: what SyncBatchNorm computes."""
    model = make_net(0)
    opt = optimizer(list(model.parameters()))
    for step in range(STEPS):
        for micro in range(MICRO):
            xs, ys = zip(*(batch(step, micro, r) for r in range(world_size)))
            (F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)) / MICRO).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.eval()
        with torch.no_grad():
            model(torch.cat([batch(step, 99, r)[0] for r in range(world_size)]))
        model.train()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def buffers_world(rank: int, world_size: int):
    torch.set_num_threads(1)
    out = {"ddp": run_ddp(rank), "ddp_local": run_ddp(rank, forward_sync_buffers=False),
           "global": run_global_batch(rank, world_size)}
    for stage in STAGES:
        out[("fp32", stage)] = run_engine(rank, stage, "fp32")
        out[("bf16", stage)] = run_engine(rank, stage, "bf16")
    out["local"] = run_engine(rank, 0, "fp32", broadcast_buffers=False)
    for stage, how, precision in ((0, "convert", "fp32"), (3, "convert", "fp32"), (3, "option", "fp32"),
                                  (1, "option", "bf16")):
        out[("syncbn", stage, how, precision)] = run_engine(rank, stage, precision, sync_bn=how)
    return out


@pytest.fixture(scope="module")
def world():
    return spawn_world(buffers_world, N, timeout_s=240)


STATS = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")


def test_running_stats_identical_on_every_rank_and_equal_to_ddp(world):
    ddp = world[0]["ddp"]["sd"]  # DDP's rank 0: what every DDP rank reads in its next forward
    for precision in ("fp32", "bf16"):
        for stage in STAGES:
            a, b = (world[r][(precision, stage)] for r in range(N))
            for key in STATS:
                assert torch.equal(a["full"][key], b["full"][key]), (precision, stage, key)
                for r in range(N):  # the shard state dict's buffers too
                    assert torch.equal(world[r][(precision, stage)]["shard_buffers"][key], a["full"][key])
                assert a["full"][key].dtype == ddp[key].dtype, (precision, stage, key)  # fp32 stats, long count
            assert torch.equal(a["full"]["bn.num_batches_tracked"], ddp["bn.num_batches_tracked"])
            tol = dict(rtol=1e-5, atol=1e-6) if precision == "fp32" else dict(rtol=0.05, atol=0.05)
            for key in STATS[:2]:
                torch.testing.assert_close(a["full"][key], ddp[key], **tol, msg=f"{precision} stage {stage} {key}")


def test_fp32_parameters_equal_ddp(world):
    ddp = world[0]["ddp"]["sd"]
    for stage in STAGES:
        for r in range(N):
            full = world[r][("fp32", stage)]["full"]
            for key in ("conv.weight", "conv.bias", "bn.weight", "bn.bias", "head.weight", "head.bias"):
                torch.testing.assert_close(full[key], ddp[key], rtol=1e-5, atol=1e-6, msg=f"stage {stage} {key}")
            torch.testing.assert_close(world[r][("fp32", stage)]["losses"], world[r]["ddp"]["losses"],
                                       rtol=1e-5, atol=1e-6)


def test_bf16_trains_at_every_stage(world):
    for stage in STAGES:
        for r in range(N):
            out = world[r][("bf16", stage)]
            assert all(v.dtype == world[r]["ddp"]["sd"][k].dtype for k, v in out["full"].items())  # fp32 out
            torch.testing.assert_close(out["losses"], world[r]["ddp"]["losses"], rtol=0.05, atol=0.05)


def test_broadcast_is_control_traffic(world):
    # the buffers (4 + 4 + 1 elements) after each of the 2 grad-enabled forwards of a step, and the
    # norm + used-mask message (1 + 6 parameters), in float64: counted apart from "total"
    assert world[0][("fp32", 0)]["control"] == MICRO * 9 + 2 * 7


def test_without_broadcast_each_rank_keeps_its_own_stats_like_ddp(world):
    for r in range(N):
        mine, ddp = world[r]["local"]["full"], world[r]["ddp_local"]["sd"]
        for key in STATS:
            torch.testing.assert_close(mine[key], ddp[key], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(world[0]["local"]["full"]["bn.running_mean"],
                              world[1]["local"]["full"]["bn.running_mean"])


@pytest.mark.parametrize("case", [(0, "convert", "fp32"), (3, "convert", "fp32"), (3, "option", "fp32"),
                                  (1, "option", "bf16")])
def test_sync_batchnorm_matches_batchnorm_over_the_global_batch(world, case):
    stage, how, precision = case
    ref = world[0]["global"]
    tol = dict(rtol=1e-5, atol=1e-5) if precision == "fp32" else dict(rtol=0.05, atol=0.05)
    for r in range(N):
        full = world[r][("syncbn", *case)]["full"]
        assert set(full) == set(ref)
        for key, value in ref.items():
            torch.testing.assert_close(full[key], value, **tol, msg=f"{case} {key}")


class ShiftNet(nn.Module):
    """A buffer the forward adds (cast with its module) and a parameter-less module's (kept)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("shift", torch.randn(3) / 3)
        self.table = nn.Module()
        self.table.register_buffer("freq", torch.randn(3) / 7)

    def forward(self, x):
        return self.fc(x + self.shift) * self.table.freq.to(x.dtype)


def test_bf16_buffers_follow_their_module_and_state_dicts_keep_fp32():
    from workers.zero import ZeroConfig, ZeroEngine

    torch.manual_seed(0)
    model = ShiftNet()
    shift, freq = model.shift.clone(), model.table.freq.clone()
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=0, precision="bf16"))
    engine.backward(engine(torch.randn(4, 3)).float().square().mean())  # a fp32 shift made the input fp32
    engine.step()
    assert model.shift.dtype == torch.bfloat16 and model.table.freq.dtype == torch.float32
    full = engine.full_state_dict()
    assert torch.equal(full["shift"], shift) and torch.equal(full["table.freq"], freq)
    assert torch.equal(engine.state_dict()["buffers"]["shift"], shift)
    engine.load_full_state_dict({**full, "shift": shift + 1})
    assert torch.equal(engine.full_state_dict()["shift"], shift + 1)


@pytest.mark.parametrize("field", ["broadcast_buffers", "sync_batchnorm"])
def test_config_fields_are_booleans(field):
    from workers.zero import ZeroConfig

    assert ZeroConfig(stage=2).broadcast_buffers is True and ZeroConfig(stage=2).sync_batchnorm is False
    with pytest.raises(ValueError, match=field):
        ZeroConfig(stage=2, **{field: "yes"})
