"""The syncs benchmark mode's counter (benchmarks/host_syncs.py): each sync warning is counted at
the line that caused it, the innermost one outside torch, and other warnings pass on. Torch's
sync debug mode warns on CUDA only, so here a plain warning with its text stands in for it
(tests/test_cuda.py checks a real one)."""

import inspect
import traceback
import warnings

from tests.conftest import script_module

host_syncs = script_module("host_syncs", folder="benchmarks")


def wait_for_the_device():
    warnings.warn(host_syncs.SYNC_WARNING)  # as torch warns at a synchronising operation
    return inspect.currentframe().f_lineno - 1


def test_each_sync_is_counted_at_its_calling_line_and_other_warnings_pass_on(monkeypatch):
    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *rest: shown.append(str(message)))
    with host_syncs.SyncCounter(on_gpu=False) as counter:
        lines = {wait_for_the_device() for _ in range(3)}
        warnings.warn("not a sync")
    (line,) = lines
    assert counter.sites == {f"tests/test_host_syncs.py:{line} wait_for_the_device": 3}
    assert shown == ["not a sync"]


def test_a_frame_inside_torch_is_passed_over_for_its_caller():
    stack = [
        traceback.FrameSummary("/venv/lib/site-packages/fairseq/sequence_generator.py", 300, "_generate"),
        traceback.FrameSummary("/checkout/spec_nmt/decoding/loop.py", 210, "generate"),
        traceback.FrameSummary(f"{host_syncs.TORCH_DIR}/_tensor.py", 40, "__bool__"),
    ]  # fmt: skip
    assert host_syncs.calling_line(stack) == "spec_nmt/decoding/loop.py:210 generate"
    assert host_syncs.calling_line(stack[:1]) == "fairseq/sequence_generator.py:300 _generate"
