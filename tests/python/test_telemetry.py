"""Per-step telemetry, the Chrome trace export and the PNG timeline."""
import json

import pytest
import torch
import torch.nn as nn

import layerstream


def run_steps(trace=True, steps=3):
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
    h = layerstream.offload(m, device="sim", trace=trace, sim_link_gbps=1.0, prefetch=2)
    x = torch.randn(16, 256, requires_grad=True)
    for _ in range(steps):
        m(x).sum().backward()
    return m, h


def test_step_stats_count_bytes_stall_and_overlap():
    m, h = run_steps()
    steps = h.step_stats()
    assert len(steps) == 2  # the last step ends at the next step boundary
    assert h.stats()["steps"] == 3  # which stats() counts already (step_stats' docstring)
    layer_bytes = 256 * 256 * 4 + 256 * 4
    for s in steps:
        # forward fetches 6 layers; backward refetches those not still in a slot
        assert s["h2d_bytes"] % layer_bytes == 0 and s["h2d_bytes"] >= 6 * layer_bytes
        assert s["d2h_bytes"] == 6 * layer_bytes  # every weight and bias gradient once
        assert s["stall_seconds"] >= 0
        assert 0.0 <= s["overlap_fraction"] <= 1.0
        assert 0 < s["slot_utilisation"] <= 1.0
        assert s["peak_device_bytes"] == h.stats()["peak_device_bytes"]
    assert h.ordering_errors() == []


def test_stats_have_the_same_keys_with_and_without_a_budget():
    """Without a budget nothing is planned resident: resident_layers is there, 0 (it
    was missing, so code written for stats() with a budget failed without one)."""
    def stats(**kw):
        m = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        h = layerstream.offload(m, device="sim", **kw)
        m(torch.randn(2, 64)).sum().backward()
        s = h.stats()
        h.detach()
        return s

    planned, unplanned = stats(budget=10**6), stats()
    assert planned.keys() == unplanned.keys()
    assert planned["resident_layers"] == 4
    assert unplanned["resident_layers"] == unplanned["resident_bytes"] == 0


def test_step_stats_go_on_across_suspend_and_resume():
    """suspend() ends the step under way and resume() starts a new scheduler: the
    per-step history keeps every step, numbered on, and the timeline keeps its
    overlap figures for the steps before."""
    m, h = run_steps(steps=2)
    held = h.stats()["max_slots_held"]
    assert held > 0
    h.suspend()
    h.resume()
    assert h.stats()["max_slots_held"] == held  # a peak since the engine was made (was 0 here)
    x = torch.randn(16, 256, requires_grad=True)
    for _ in range(2):
        m(x).sum().backward()
    steps = h.step_stats()
    assert [s["step"] for s in steps] == [0, 1, 2]  # the fourth ends at the next boundary
    assert h.stats()["steps"] == 4
    layer_bytes = 256 * 256 * 4 + 256 * 4
    for s in steps:
        assert s["d2h_bytes"] == 6 * layer_bytes and 0.0 <= s["overlap_fraction"] <= 1.0
    assert h.ordering_errors() == []


def test_trace_export_is_valid_chrome_json_with_lanes_and_slices(tmp_path):
    m, h = run_steps()
    path = tmp_path / "trace.json"
    h.export_trace(str(path))
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    assert {"compute", "transfer", "grad"} <= lanes
    names = [e["name"] for e in events if e.get("ph") == "X"]
    assert any(n.startswith("H2D ") for n in names)
    assert any(n.startswith("fwd ") for n in names) and any(n.startswith("bwd ") for n in names)
    assert any(n.startswith("D2H grad ") for n in names)
    for e in events:
        if e.get("ph") == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0


def test_timeline_png(tmp_path, monkeypatch):
    """Each lane of the trace gets one bar per slice, in its row and its colour, and a
    line per step boundary; the bars show in the PNG. Only the PNG's header was checked,
    so a chart with the lane names and nothing drawn passed."""
    pytest.importorskip("matplotlib")
    import matplotlib.axes
    import matplotlib.image
    from layerstream.timeline import _COLORS

    m, h = run_steps(steps=2)
    h.export_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    slices = [e for e in events if e.get("ph") == "X"]
    drawn, lines = [], []
    barh, axvline = matplotlib.axes.Axes.broken_barh, matplotlib.axes.Axes.axvline
    monkeypatch.setattr(matplotlib.axes.Axes, "broken_barh",
                        lambda ax, bars, yrange, **kw: drawn.append((list(bars), yrange, kw)) or barh(ax, bars, yrange, **kw))
    monkeypatch.setattr(matplotlib.axes.Axes, "axvline",
                        lambda ax, x=0, *a, **kw: lines.append(x) or axvline(ax, x, *a, **kw))
    path = tmp_path / "timeline.png"
    h.plot_timeline(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(drawn) == len(lanes) and {"compute", "transfer", "grad"} <= set(lanes.values())
    t0 = min(e["ts"] for e in slices)
    span_ms = (max(e["ts"] + e["dur"] for e in slices) - t0) / 1000.0
    img = (matplotlib.image.imread(str(path))[..., :3] * 255).round().astype(int)
    wide = 0
    for row, ((bars, yrange, kw), tid) in enumerate(zip(drawn, sorted(lanes))):
        lane = lanes[tid]
        own = sorted(((e["ts"] - t0) / 1000.0, e["dur"] / 1000.0) for e in slices if e["tid"] == tid)
        assert own and sorted(bars) == pytest.approx(own), lane
        assert yrange == (row - 0.4, 0.8) and kw["facecolors"] == _COLORS[lane], lane
        # A bar over 1/200 of the time axis (over 5 pixels of ~1200) has pixels of exactly
        # its colour inside it (narrower ones may be blended into their neighbours).
        if max(d for _, d in own) > span_ms / 200:
            wide += 1
            rgb = [int(_COLORS[lane][i:i + 2], 16) for i in (1, 3, 5)]
            assert (img == rgb).all(-1).any(), lane
    assert wide >= 1  # compute's bars are milliseconds long
    assert len(lines) == sum(e.get("ph") == "i" for e in events) >= 1  # a line per step boundary


def test_export_without_trace_is_a_clear_error(tmp_path):
    m, h = run_steps(trace=False, steps=1)
    with pytest.raises(layerstream.LayerstreamError, match="trace=True"):
        h.export_trace(str(tmp_path / "t.json"))


def test_step_stats_of_a_constructed_schedule():
    """Figures known from the schedule itself. Two Linear layers, four slots (slots=4),
    prefetch 1, forward + backward per step: in each replayed step layer 1 is prefetched
    while layer 0 is in use, so at most 2 slots are held at once (each layer holds at
    most one): slot_utilisation = 2 / 4 exactly. The forward fetches both layers (h2d =
    2 layers); backward finds them still in their slots (4 slots hold both), so nothing
    more is copied; every weight and bias gradient goes back once (d2h = 2 layers).
    (test_step_stats_count_bytes_stall_and_overlap checks the figures' ranges on a
    schedule where they are not known in advance.)"""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    h = layerstream.offload(m, device="sim", trace=True, slots=4, prefetch=1)
    x = torch.randn(8, 64, requires_grad=True)
    for _ in range(4):
        m(x).sum().backward()
    assert h.stats()["slots"] == 4
    steps = h.step_stats()
    assert len(steps) == 3
    layer = 64 * 64 * 4 + 64 * 4
    for s in steps[1:]:  # replayed steps (the first one recorded the order)
        assert s["max_slots_held"] == 2, s
        assert s["slot_utilisation"] == 0.5, s
        assert s["h2d_bytes"] == 2 * layer, s
        assert s["d2h_bytes"] == 2 * layer, s
        # 2 forward + 2 backward acquires; only the step's first layer is fetched on
        # demand (nothing prefetches across a step boundary without cache_across_steps)
        assert (s["acquires"], s["hits"], s["misses"]) == (4, 3, 1), s
        assert s["peak_device_bytes"] == 4 * layer  # the 4 slots (parts 256-aligned: no padding here)
    assert h.ordering_errors() == []
