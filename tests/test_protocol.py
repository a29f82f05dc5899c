"""Batch: pure logic, checked against numpy slicing; transport through a real Ray object store.
The weights' device path: its layout and its choice (CUDA IPC itself: tests/gpu)."""
import numpy as np
import pytest
import torch

from hpcrl.controller.batch import Batch, Weights
from hpcrl.controller.device_weights import ALIGN, Placement, pack, shares_gpu, unpack


def sample(n=7):
    return Batch({"x": torch.arange(n * 3).reshape(n, 3), "m": torch.rand(n, 2, dtype=torch.bfloat16)},
                 {"text": np.array([f"p{i}" for i in range(n)], dtype=object)}, {"step": 4})


def test_chunk_matches_numpy_array_split_and_concat_restores_order():
    for n in range(1, 12):
        b = sample(n)
        for k in (1, 2, 3, 4, 5):
            parts = b.chunk(k)
            assert [len(p) for p in parts] == [len(a) for a in np.array_split(np.arange(n), k)]
            back = Batch.concat(parts)
            assert torch.equal(back["x"], b["x"]) and list(back["text"]) == list(b["text"])


def test_split_repeat_reorder_index():
    b = sample(7)
    assert [len(p) for p in b.split(3)] == [3, 3, 1]
    assert list(b.repeat(2)["text"][:4]) == ["p0", "p0", "p1", "p1"]
    assert list(b.repeat(2, interleave=False)["text"][6:9]) == ["p6", "p0", "p1"]
    perm = np.random.default_rng(0).permutation(7)
    r = b.reorder(perm)
    assert torch.equal(r["x"], b["x"][torch.as_tensor(perm)]) and list(r["text"]) == [f"p{i}" for i in perm]
    with pytest.raises(ValueError, match="permutation"):
        b.reorder([0, 0, 1, 2, 3, 4, 5])
    mask = torch.tensor([True, False] * 3 + [True])
    assert list(b.index(mask)["text"]) == ["p0", "p2", "p4", "p6"]


def test_union_select_pop():
    b = sample(4)
    extra = Batch({"y": torch.ones(4)}, meta={"step": 4, "t": 1.0})
    u = b.union(extra)
    assert set(u.keys()) == {"x", "m", "text", "y"} and u.meta == {"step": 4, "t": 1.0}
    with pytest.raises(ValueError, match="tensor 'x' differs"):
        b.union(Batch({"x": torch.zeros(4, 3, dtype=torch.long)}))
    with pytest.raises(ValueError, match="meta 'step' differs"):
        b.union(Batch({"y": torch.ones(4)}, meta={"step": 5}))
    with pytest.raises(ValueError, match="4 and 3"):
        b.union(Batch({"y": torch.ones(3)}))
    popped = u.pop("y")
    assert "y" not in u and popped.keys() == ["y"]
    with pytest.raises(KeyError, match="'nope'"):
        u.select("nope")
    with pytest.raises(ValueError, match="first dimension"):
        Batch({"a": torch.ones(3), "b": torch.ones(4)})


def test_pad_to_multiple_appends_copies_after_the_real_rows():
    b = sample(7)
    padded, rec = b.pad_to_multiple(4)
    assert len(padded) == 8 and rec.pad == 1 and torch.equal(padded["x"][7], b["x"][0])
    assert rec.size == 7 and torch.equal(padded["x"][:rec.size], b["x"])
    same, rec0 = b.pad_to_multiple(7)
    assert same is b and rec0.pad == 0


def test_round_trip_through_ray_keeps_dtypes_and_gives_writable_tensors(tmp_path):
    import ray

    from hpcrl.raycluster.session import start_local

    start_local(["x"], run_dir=tmp_path, num_cpus=1)
    try:
        b = sample(5)
        back = ray.get(ray.put(b))
        assert back["m"].dtype == torch.bfloat16 and torch.equal(back["m"], b["m"])
        assert torch.equal(back["x"], b["x"]) and list(back["text"]) == list(b["text"]) and back.meta == {"step": 4}
        back["x"].add_(1)   # a private copy: writing must not touch the stored object
        assert torch.equal(ray.get(ray.put(b))["x"], b["x"])
        # a state dict travels the same way, each tensor as it was (the rollout's weights)
        w = Weights({"w": torch.randn(3, 4), "h": torch.randn(5, dtype=torch.bfloat16), "n": torch.arange(3)})
        got = ray.get(ray.put(w))
        assert isinstance(got, Weights) and got.keys() == w.keys()
        assert all(got[k].dtype == w[k].dtype and torch.equal(got[k], w[k]) for k in w)
    finally:
        ray.shutdown()


def test_packed_weights_unpack_bitwise_as_the_host_path_casts_them():
    g = torch.Generator().manual_seed(0)
    weights = {"w": torch.randn(3, 5, generator=g), "h": torch.randn(7, generator=g).bfloat16(),
               "n": torch.arange(4), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
               "p": torch.nn.Parameter(torch.randn(2, 2, generator=g))}     # a module's, requiring grad
    for dtype in (torch.bfloat16, None):
        buffer, layout = pack(weights, dtype, "cpu")
        assert buffer.dtype == torch.uint8 and buffer.dim() == 1
        assert all(s.offset % ALIGN == 0 for s in layout.values())
        back = unpack(buffer, layout)
        assert back.keys() == weights.keys()
        for k, v in weights.items():       # what export_weights sends as Weights: floating ones cast
            want = v.detach().to(dtype if dtype and v.is_floating_point() else v.dtype)
            assert back[k].dtype == want.dtype and back[k].shape == want.shape and torch.equal(back[k], want), k
            assert back[k].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()   # views, no copy
        ends = sorted((s.offset, s.offset + back[k].nbytes) for k, s in layout.items())
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:])) and ends[-1][1] <= buffer.numel()


def test_weights_stay_on_the_gpu_only_when_every_reader_shares_the_producers():
    actor = Placement("node1", 100, "GPU-a")
    beside = Placement("node1", 200, "GPU-a")
    assert shares_gpu(actor, [beside]) and shares_gpu(actor, [beside, Placement("node1", 201, "GPU-a")])
    assert not shares_gpu(actor, [beside, Placement("node1", 201, "GPU-b")])     # one rank on another GPU
    assert not shares_gpu(actor, [Placement("node2", 200, "GPU-a")])             # another host
    assert not shares_gpu(actor, [actor])              # its own process: CUDA IPC does not open its own handle
    assert not shares_gpu(actor, [])
    on_cpu = Placement("node1", 100, None)
    assert not shares_gpu(on_cpu, [Placement("node1", 200, None)])
    assert Placement.of("cpu") == Placement.of(torch.device("cpu")) and Placement.of("cpu").gpu is None
