"""memory.peak reads XLA's dumps: shapes to bytes, live ranges to the bytes live over the
schedule, and on the tiny step a peak that agrees with ``memory_analysis()``.

Oracles: hand-counted bytes of hand-written HLO and live-range text; XLA's own
``compiled.memory_analysis()`` for the real step (the schedule's peak cannot exceed the
packed allocation by more than aliasing, nor fall far below it)."""

import re

import pytest

from moejax.memory import peak

HLO = """HloModule jit_train_step

ENTRY %main (p: f32[4,8]) -> f32[4,8] {
  %p = f32[4,8]{1,0} parameter(0), metadata={op_name="state.params['w']"}
  %t = (bf16[2,3]{1,0}, (f8e4m3fn[16]{0}, s32[]), /*index=2*/pred[5]{0}) custom-call(%p), metadata={op_name="jit(train_step)/kernel"}
  %a = f32[4,8]{1,0} add(%p, %p), metadata={op_name="jit(train_step)/add"}
  ROOT %r = f32[4,8]{1,0} multiply(%a, %a)
}
"""

LIVE_RANGES = """HloLiveRange (max 4):
  InstructionSequence:
    0:p
    1:t
    2:a
    3:r
  BufferLiveRange:
    p{}:0-4
    t{}:1-1
    t{0}:1-2
    t{1,0}:1-3
    a{}:2-3
    r{}:3-4
"""


def test_shapes_of_arrays_and_nested_tuples_become_bytes():
    shape, rest = peak.parse_shape("(bf16[2,3]{1,0}, (f8e4m3fn[16]{0}, s32[]), "
                                   "/*index=2*/pred[5]{0}) custom-call(%p)")
    assert shape == (12, (16, 4), 5) and rest.startswith(" custom-call")
    assert peak.buffer_bytes(shape, "1,0") == 16 and peak.buffer_bytes(shape, "") == 24
    assert peak.parse_shape("f32[]")[0] == 4
    # a token (send/recv, after-all) holds no bytes; sub-byte types take a byte an element
    assert [peak.parse_shape(s)[0] for s in ("token[]", "s4[8]", "u2[3]", "f4e2m1fn[6]",
                                             "s64[2]", "c128[1]", "f8e5m2[4]")] == [
        0, 8, 3, 6, 16, 16, 4]
    with pytest.raises(ValueError, match="q7"):
        peak.parse_shape("q7[3]")


def test_live_set_sums_the_buffers_live_at_each_instruction():
    live = peak.live_set(LIVE_RANGES, peak.parse_hlo(HLO))
    # p: 128 B throughout; t's table 24 B at 1, its bf16 12 B at 1-2, its f8 16 B at 1-3;
    # a and r: 128 B each over their ranges.
    assert live.live.tolist() == [128, 128 + 24 + 12 + 16, 128 + 12 + 16 + 128,
                                  128 + 16 + 128 + 128, 128 + 128]
    assert live.peak == 3 and live.schedule[3] == "r"
    assert {b.name for b in live.at(3)} == {"p", "t", "a", "r"}
    assert "state.params['w']" in next(b.label for b in live.buffers if b.name == "p")


def test_tiny_step_peak_agrees_with_xla(capsys):
    peak.main(["--preset", "tiny", "--set", "train.remat=selective", "--top", "5"])
    out = capsys.readouterr().out
    compiled = float(re.search(r"compiled step: ([\d.]+) GiB", out).group(1))
    scheduled = float(re.search(r"peak of the schedule: ([\d.]+) GiB", out).group(1))
    assert 0.8 * compiled <= scheduled <= 1.05 * compiled, out
    assert len(re.findall(r"^\s+[\d.]+\s+\d+ x ", out, re.M)) == 5, out
