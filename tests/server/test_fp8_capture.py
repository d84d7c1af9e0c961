"""HS_CAPTURE_DTYPE=fp8 through the real capture path (issue #35): the real patched forward on the CPU
(``lab.sglang_sim``), the real hook quantizing each plane before its copy, the real writer, the readers.

The samples' raw fp8 rows and scales are exactly :func:`hs_patch.server.fp8.quantize` of the
transformers states (which bf16 capture stores bit for bit, tests/server/test_capture.py); read
dequantized they lie within the stated fp8 envelope of those states; the fingerprints are of the
states before quantization and the checksums of the bytes stored (fp8 rows and scales); the
header-only and deep checks of the directory pass; a chunked prompt's scales are whole.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import FAMILY_REPRESENTATIVES
from hs_patch.engine.releases import RELEASES, TARGET, apply_edits
from hs_patch.host.fidelity import check as fidelity_check
from hs_patch.host.fidelity.rows import check_rows
from hs_patch.host.patching import inspection
from hs_patch.samples import lazy_sample, reader, store
from hs_patch.server import config, fingerprint, fp8, hook
from lab.sglang_sim import Part, Reference, ReleaseCode, Sim, make_batch, reference

LAYERS = (0, 1, 3)


@pytest.fixture(scope="module")
def refs(tiny_model) -> dict[str, Reference]:
    g = torch.Generator().manual_seed(35)
    lengths = {"a": 23, "b": 5, "c": 11}
    return {k: reference(tiny_model, torch.randint(3, 250, (n,), generator=g).tolist()) for k, n in lengths.items()}


def capture(release_sources, tiny_model, refs, d: Path, version: str, final: str) -> None:
    """b and c whole and a's first 8 tokens in one pass, then a's last 15 (a chunked prompt), as fp8."""
    cfg = config.CaptureConfig(enabled=True, directory=str(d), layers=LAYERS, final=final, slots=2, slot_tokens=64,
                               dtype="fp8")
    h = hook.CaptureHook(cfg, hidden_size=tiny_model.config.hidden_size, metadata={"sglang_release": version})
    site = release_sources[version]
    sim = Sim(version, apply_edits(RELEASES[version], (site / TARGET).read_text()), tiny_model, refs, hook=h,
              code=ReleaseCode.read(site))
    try:
        out = sim.forward(make_batch(refs, [Part("b", 0, 5), Part("c", 0, 11), Part("a", 0, 8)]))
        assert torch.equal(out, torch.cat([refs["b"].post_norm, refs["c"].post_norm, refs["a"].post_norm[:8]]))
        sim.forward(make_batch(refs, [Part("a", 8, 15)]))
    finally:
        h.close()


def states(ref: Reference, final: str) -> dict[str, torch.Tensor]:
    out = {store.layer_plane(i): ref.layer_in[i] for i in LAYERS}
    if final in ("pre", "both"):
        out["final.pre_norm"] = ref.pre_norm
    if final in ("post", "both"):
        out["final.post_norm"] = ref.post_norm
    return out


def quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = torch.empty(x.shape, dtype=torch.float8_e4m3fn), torch.empty(x.shape[0])
    fp8.quantize(x, torch.empty_like(x), q, s)
    return q, s


@pytest.mark.parametrize("final", ["both", "none"])
@pytest.mark.parametrize("version", FAMILY_REPRESENTATIVES)
def test_fp8_round_trip_through_the_real_hook(version, final, release_sources, tiny_model, refs, tmp_path):
    d = tmp_path / "dump"
    capture(release_sources, tiny_model, refs, d, version, final)
    got = {s.key: s for s in reader.iter_samples(d)}
    assert set(got) == {store.sample_key(refs[k].ids) for k in "abc"}
    for k in "abc":
        s, ref = got[store.sample_key(refs[k].ids)], refs[k]
        n, h = ref.ids.shape[0], tiny_model.config.hidden_size
        assert s.metadata["format"] == store.FORMAT_FP8 and s.metadata["dtype"] == fp8.DTYPE and s.fp8
        assert s.metadata[fp8.META] == fp8.SCHEME and s.metadata[fp8.SOURCE_META] == "bfloat16"
        assert s.metadata["parts"] == ("2" if k == "a" else "1")
        doc, cdoc = fingerprint.parse(s.metadata), fingerprint.parse_checksums(s.metadata)
        fps, css = s.tensors[fingerprint.TENSOR], s.tensors[fingerprint.CHECKSUM_TENSOR]
        for name, x in states(ref, final).items():
            q, sc = quantized(x)
            raw = s.plane(name, raw=True)
            assert raw.dtype == torch.float8_e4m3fn and raw.shape == (n, h)
            assert torch.equal(raw.view(torch.uint8), q.view(torch.uint8)), name  # the bytes, exactly
            assert torch.equal(s.scale(name), sc), name
            deq = s.plane(name)
            assert deq.dtype == torch.bfloat16
            err = (deq.float() - x.float()).abs()
            bound = (fp8.REL_ERROR + 2 ** -8) * x.float().abs() + fp8.ABS_ERROR * sc.reshape(-1, 1)
            assert bool((err <= bound).all()), name  # the envelope docs/samples.md states
            assert not torch.equal(deq, x), "a tiny random model's states are not all fp8 values"
            # fingerprints: of the state before quantization; checksums: of the fp8 bytes with the scale folded in
            assert torch.allclose(fps[:, doc["streams"].index(name)], fingerprint.block_sums(x), rtol=1e-5, atol=1e-5)
            want = fingerprint.word_sums(q)
            fp8.add_scale_word(want, sc)
            assert torch.equal(css[:, cdoc["streams"].index(name)], want), name
            with lazy_sample.open_sample(s.path) as lazy:  # the streaming reader: the same rows, both ways
                assert lazy.fp8 and torch.equal(lazy.tensor(name), deq)
                assert torch.equal(lazy.rows(name, 1, 4), deq[1:4])
                assert torch.equal(lazy.rows(name, 1, 4, raw=True).view(torch.uint8), q[1:4].view(torch.uint8))
        if final == "none":  # the check rows stay what the engine computed, bf16
            rows = s.tensors[store.CHECK_TENSOR]
            assert rows.dtype == torch.bfloat16 and torch.equal(rows, ref.post_norm[-rows.shape[0]:])
        plane_bytes = sum(s.plane(p, raw=True).numel() for p in s.planes)
        assert plane_bytes == len(s.planes) * n * h  # one byte a value
    assert reader.check_dir(d).clean and reader.check_dir(d, deep=False).clean
    whole = inspection.inspect(str(d), deep=True)
    assert whole["clean"] and whole["ok"] == 3
    one = inspection.inspect(str(got[store.sample_key(refs["a"].ids)].path), deep=True)
    assert one["clean"] and "as fp8 (float8_e4m3fn" in one["message"]
    assert one["tensors"]["layer.0"] == [[23, h], "float8_e4m3fn"]
    assert one["tensors"]["layer.0.scale"] == [[23], "float32"]


def test_fp8_zero_rows_and_the_scale_in_the_checksum():
    """A row of zeros stores zeros with the smallest normal scale; a changed scale changes the checksum."""
    x = torch.randn(4, 64).bfloat16()
    x[1] = 0
    q, s = quantized(x)
    assert s[1] == fp8.MIN_SCALE and not q[1].float().any()
    assert torch.equal(fp8.dequantize(q, s)[1], torch.zeros(64, dtype=torch.bfloat16))
    assert float(q.float().abs().amax()) == fp8.FP8_MAX
    a = fingerprint.word_sums(q)
    fp8.add_scale_word(a, s)
    s2 = s.clone()
    s2[2] *= 2
    b = fingerprint.word_sums(q)
    fp8.add_scale_word(b, s2)
    assert torch.equal(a[[0, 1, 3]], b[[0, 1, 3]]) and not torch.equal(a[2], b[2])


def test_fp8_samples_keep_the_check_rows_in_bf16_for_the_logits(release_sources, tiny_model, refs, tmp_path):
    """check_rows judges fp8 rows (tests/server/test_fp8_fingerprints.py: clean pass, sabotage rejected); the
    logit checks read the LM head's input at the last rows, kept in bf16 beside the fp8 planes (HS_CAPTURE_CHECK_ROWS,
    16 by default), exactly what the engine computed (tests/fidelity/test_fp8_drive.py: the driver's whole check)."""
    d = tmp_path / "dump"
    capture(release_sources, tiny_model, refs, d, FAMILY_REPRESENTATIVES[-1], "both")
    head = fidelity_check.LMHead(torch.zeros(2, tiny_model.config.hidden_size), tiny_model.model.norm.weight, 1e-6)
    for e in store.read_manifest(d).values():
        with lazy_sample.open_sample(d / e["file"], entry=e) as s:
            r = check_rows(s, None)
            assert r.problems == [] and "bytes = checksums (every stored plane)" in r.every_row
            n = s.num_tokens
            first = fidelity_check.check_from(s)
            name, ref = next((k, v) for k, v in refs.items() if store.sample_key(v.ids) == s.key)
            # the last part's last rows: a's second part (15 tokens) alone in its pass keeps 15; b (5) and c (11)
            # shared a pass with a's first part, whose 5 + 11 + 8 rows do not fit the 16 rows of room of a
            # 64-token slot (a quarter): 5 each (passes.fit_check_counts)
            assert first == n - {"a": 15, "b": 5, "c": 5}[name]
            states, plane = head.post_norm(s, first, n)
            assert plane == store.CHECK_TENSOR and torch.equal(states, ref.post_norm[first:])


def test_capture_dtype_knob():
    assert config.from_env({"HS_CAPTURE": "1"}).dtype == "bf16"
    assert config.from_env({"HS_CAPTURE": "1", "HS_CAPTURE_DTYPE": "FP8"}).dtype == "fp8"
    with pytest.raises(config.ConfigError, match="HS_CAPTURE_DTYPE='fp16'"):
        config.from_env({"HS_CAPTURE_DTYPE": "fp16"})


def test_a_sample_whose_format_and_planes_disagree_is_refused(tmp_path):
    """An fp8 sample must say format 5 and a format-5 sample must hold fp8 planes (never read as the other)."""
    meta = {"format": store.FORMAT, "dtype": fp8.DTYPE, fp8.META: fp8.SCHEME, fp8.SOURCE_META: "bfloat16"}
    with pytest.raises(store.SampleError, match="fp8 planes are format"):
        reader.is_fp8(tmp_path / "x", meta)
    assert reader.is_fp8(tmp_path / "x", dict(meta, format=store.FORMAT_FP8))
    # fp8 planes whose header names no scheme were read as the e4m3 codes themselves (max 448), unscaled, and
    # exported so; and planes "dequantized" to what their header names as the source, fp8 itself, saturated
    for bad, why in (({k: v for k, v in meta.items() if k != fp8.META}, "without a quantization scheme"),
                     (dict(meta, format=store.FORMAT_FP8, **{fp8.SOURCE_META: ""}), "not a dtype they can be"),
                     (dict(meta, format=store.FORMAT_FP8, **{fp8.SOURCE_META: fp8.DTYPE}), "not a dtype they can be")):
        with pytest.raises(store.SampleError, match=why):
            reader.is_fp8(tmp_path / "x", bad)
    with pytest.raises(store.SampleError, match="fp8 planes are format"):
        reader.is_fp8(tmp_path / "x", {"format": store.FORMAT_FP8, "dtype": "bfloat16"})
    with pytest.raises(store.SampleError, match="not one this hs_patch reads"):
        reader.is_fp8(tmp_path / "x", dict(meta, **{fp8.META: "fp8/per-block-128"}))
    assert not reader.is_fp8(tmp_path / "x", {"format": store.FORMAT, "dtype": "bfloat16"})


def test_a_changed_scale_in_the_file_fails_its_row_checksum(release_sources, tiny_model, refs, tmp_path):
    """The host's checksum of an fp8 row covers its scale: one scale's byte changed on disk fails that row only."""
    from hs_patch.host.fidelity.checksums import tensor_spans
    from lab.sample_files import flip_byte

    d = tmp_path / "dump"
    capture(release_sources, tiny_model, refs, d, FAMILY_REPRESENTATIVES[-1], "both")
    key = store.sample_key(refs["c"].ids)
    path = d / store.read_manifest(d)[key]["file"]
    start, _ = tensor_spans(path)[fp8.scale_name("layer.1")]
    flip_byte(path, start + 4 * 5 + 1, 0x01)  # row 5's scale, a low mantissa bit: within the fp8 envelope
    with lazy_sample.open_sample(path) as s:
        problems = check_rows(s, None).problems
    assert problems == ["layer.1: the bytes of 1 of 11 rows (e.g. [5]) differ from what the forward pass held at "
                        "capture: rows misplaced, replaced, shifted or corrupted between the GPU and the file"], \
        problems
