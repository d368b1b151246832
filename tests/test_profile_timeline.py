"""bench/profile_engine.py's timeline: GPU busy time and idle gaps inside a marker's span, from the
GPU's own events (not the marker's mirror on the GPU timeline, which once made every gap look busy)."""

from __future__ import annotations

from types import SimpleNamespace

from torch.autograd import DeviceType

from bench.profile_engine import timeline


def _ev(name: str, start: float, end: float, device: DeviceType, annotation: bool = False) -> SimpleNamespace:
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                           is_user_annotation=annotation)


class _Prof:
    def __init__(self, events: list) -> None:
        self._events = events

    def events(self) -> list:
        return self._events


def test_timeline_counts_kernels_not_the_markers_gpu_mirror() -> None:
    # times in us: the CPU span 0..10000; the marker's mirror on the GPU 100..9000; kernels 100..2100
    # and 5100..9000 with a 3000 us gap between them while the CPU ran "aten::_scaled_mm"
    evs = [
        _ev("case", 0, 10000, DeviceType.CPU, annotation=True),
        _ev("case", 100, 9000, DeviceType.CUDA, annotation=True),
        _ev("gemm", 100, 2100, DeviceType.CUDA),
        _ev("aten::_scaled_mm", 2000, 5000, DeviceType.CPU),
        _ev("attn", 5100, 9000, DeviceType.CUDA),
    ]
    out = timeline(_Prof(evs), "case")
    first = out.splitlines()[0]
    assert "GPU busy 5.90 ms" in first, out  # 2.0 + 3.9, not the mirror's 8.9
    assert "idle gaps 3.00 ms in 1" in first and "lead 0.10 ms" in first, out
    assert "gap 3000 us before attn" in out and "aten::_scaled_mm" in out, out


def test_timeline_without_kernels() -> None:
    evs = [_ev("case", 0, 10, DeviceType.CPU, annotation=True), _ev("case", 1, 9, DeviceType.CUDA, annotation=True)]
    assert timeline(_Prof(evs), "case") == "(no kernels)"
