"""The planner's cache key for a model block (workers/zero/planner/model_key.py)."""

from workers.zero.planner.model_key import ModelKey


def test_equal_blocks_are_one_key_whatever_their_key_order():
    one = ModelKey.of({"factory": "pkg.mod:fn", "kwargs": {"width": 8, "layers": [1, 2]}})
    two = ModelKey.of({"kwargs": {"layers": (1, 2), "width": 8}, "factory": "pkg.mod:fn"})
    assert one == two and hash(one) == hash(two)
    assert len({one, two}) == 1


def test_scalars_keep_their_type():
    keys = {ModelKey.of({"kwargs": {"width": value}}) for value in (1, 1.0, True, "1")}
    assert len(keys) == 4


def test_the_block_comes_back_as_a_fresh_dict():
    block = {"factory": "pkg.mod:fn", "kwargs": {"nested": {"b": [1, {"c": None}], "a": 2.5}}}
    key = ModelKey.of(block)
    thawed = key.block()
    assert thawed == block and thawed is not block
    thawed["kwargs"]["nested"]["a"] = 0
    assert key.block() == block
