"""Timeline: spans only while active, lanes as stable tids, Chrome-trace JSON written atomically."""

import json
import threading

from paraloom.trace import Timeline


def _spans(doc):
    return [e for e in doc["traceEvents"] if e["ph"] == "X"]


def _meta(doc, name):
    return {e["tid"]: e["args"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == name}


def test_inactive_timeline_records_nothing():
    tl = Timeline(0)
    assert tl.active is False
    t = tl.now()
    tl.span("forward 0", "compute", t, t + 1e-3)
    assert _spans(tl.to_chrome()) == []
    assert _meta(tl.to_chrome(), "thread_name") == {}  # no lane was used


def test_lanes_map_to_tids_in_first_use_order():
    tl = Timeline(2)
    tl.active = True
    t = tl.now()
    for lane in ("comm", "compute", "comm", "step", "compute"):
        tl.span(f"x on {lane}", lane, t, t + 1e-4)
    doc = tl.to_chrome()
    assert _meta(doc, "thread_name") == {1: {"name": "comm"}, 2: {"name": "compute"}, 3: {"name": "step"}}
    assert _meta(doc, "thread_sort_index") == {1: {"sort_index": 1}, 2: {"sort_index": 2},
                                               3: {"sort_index": 3}}
    assert [(e["cat"], e["tid"]) for e in _spans(doc)] == [
        ("comm", 1), ("compute", 2), ("comm", 1), ("step", 3), ("compute", 2)]
    assert {e["pid"] for e in doc["traceEvents"]} == {2}


def test_write_gives_chrome_json_in_microseconds(tmp_path):
    tl = Timeline(3)
    tl.active = True
    tl.span("all_reduce bucket 0", "comm", tl.origin + 0.5, tl.origin + 0.75, nbytes=4096)
    tl.active = False
    tl.span("ignored", "comm", tl.origin + 1.0, tl.origin + 2.0)
    path = tl.write(tmp_path / "trace" / "rank3.json")
    assert sorted(p.name for p in (tmp_path / "trace").iterdir()) == ["rank3.json"]  # no temp file left
    doc = json.loads(path.read_text())
    assert doc["displayTimeUnit"] == "ms"
    assert doc["otherData"]["rank"] == 3
    assert _meta(doc, "process_name") == {0: {"name": "rank 3"}}
    [span] = _spans(doc)
    assert span["name"] == "all_reduce bucket 0" and span["ph"] == "X" and span["pid"] == 3
    assert abs(span["ts"] - 500_000) < 1e-3 and abs(span["dur"] - 250_000) < 1e-3
    assert span["args"] == {"nbytes": 4096}


def test_spans_from_many_threads_all_arrive():
    tl = Timeline(0)
    tl.active = True
    start = threading.Barrier(4)

    def record(lane):
        start.wait()
        for i in range(500):
            t = tl.now()
            tl.span(f"{lane} {i}", lane, t, t)

    threads = [threading.Thread(target=record, args=(f"lane{k}",)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    doc = tl.to_chrome()
    spans = _spans(doc)
    assert len(spans) == 2000
    lanes = _meta(doc, "thread_name")
    assert sorted(lanes) == [1, 2, 3, 4]
    assert all(e["cat"] == lanes[e["tid"]]["name"] for e in spans)
    for k in range(4):  # each thread's own spans stay in its order
        mine = [e["name"] for e in spans if e["cat"] == f"lane{k}"]
        assert mine == [f"lane{k} {i}" for i in range(500)]
