"""Parts: a stacked entry's checkpoint tensors held as arrays give the extents a scan of every part
gives, and travel to every rank as a few arrays."""

from __future__ import annotations

import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from rank0load.checkpoint._entries import Parts
from rank0load.checkpoint._format import TensorHeader


def _scan(tensors, start, nbytes):
    """The extents as the manifest computed them before Parts: every part scanned in order."""
    out, base, stop = [], 0, start + nbytes
    for t in tensors:
        lo, hi = max(start, base), min(stop, base + t.nbytes)
        if lo < hi:
            out.append((t.file, t.offset + lo - base, hi - lo, lo - start))
        base += t.nbytes
    return out


@st.composite
def cases(draw):
    sizes = draw(st.lists(st.integers(0, 50), min_size=1, max_size=30))
    files = draw(
        st.lists(
            st.sampled_from(["/c/a.safetensors", "/c/b.safetensors"]),
            min_size=len(sizes),
            max_size=len(sizes),
        )
    )
    offsets = draw(st.lists(st.integers(8, 10_000), min_size=len(sizes), max_size=len(sizes)))
    tensors = [
        TensorHeader(f, f"k{i}", "U8", (n,), o, n) for i, (f, o, n) in enumerate(zip(files, offsets, sizes))
    ]
    total = sum(sizes)
    start = draw(st.integers(0, max(0, total - 1)))
    return tensors, start, draw(st.integers(0, total - start))


@settings(max_examples=300, deadline=None)
@given(cases())
def test_extents_equal_a_scan_of_every_part(case):
    tensors, start, nbytes = case
    parts = Parts.of(tensors)
    assert parts.extents(start, nbytes) == _scan(tensors, start, nbytes)
    assert parts.nbytes == sum(t.nbytes for t in tensors)
    assert parts.extents(0, parts.nbytes) == _scan(tensors, 0, parts.nbytes)  # every part's bytes
    assert len(parts) == len(tensors)
    sent = pickle.loads(pickle.dumps(parts))  # what the other ranks hold: the same parts and extents
    assert sent == parts and len(sent) == len(parts)
    assert sent.extents(start, nbytes) == parts.extents(start, nbytes)


def test_a_layer_of_experts_pickles_small():
    """512 parts (256 experts x 2 sources): three arrays and the file name, ~20 bytes a part."""
    tensors = [
        TensorHeader(
            "/c/model-00001-of-00063.safetensors",
            f"model.layers.0.block_sparse_moe.experts.{e}.w{w}.weight",
            "F8_E4M3",
            (128, 128),
            8 + 16384 * (3 * e + w),
            16384,
        )
        for e in range(256)
        for w in (1, 3)
    ]
    assert len(pickle.dumps(Parts.of(tensors), protocol=pickle.HIGHEST_PROTOCOL)) < 512 * 24
