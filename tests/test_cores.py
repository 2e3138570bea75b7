"""``CoreShare``: when a dynamic client's CPU forward pass leaves cores to its decoders."""

from __future__ import annotations

import threading

from concurrency_helpers import body

from histoinfer import ServerModel
from histoinfer.clients.cores import CoreShare
from histoinfer.clients.inprocess import _decode_chunk
from histoinfer.errors import InvalidRequestError
from histoinfer.models.device_thread import device_thread


def share_with(forward_ms: float, decode_ms: float, decode_threads: int = 1) -> CoreShare:
    share = CoreShare(decode_threads)
    share.record_forward(10, forward_ms * 10 / 1000, threads=4, all_threads=4)
    share.record_decode(10, decode_ms * 10 / 1000)
    return share


def test_the_decoders_cores_are_left_until_both_costs_are_known() -> None:
    # An OpenMP team beside busy decoders is the expensive mistake (3-4.5x on 2 cores); a pass
    # on fewer threads costs at most threads / (threads - left).
    assert CoreShare(1).cores_to_leave(all_threads=2) == 1
    assert CoreShare(3).cores_to_leave(all_threads=8) == 3
    only_decode = CoreShare(1)
    only_decode.record_decode(1, 0.001)
    assert only_decode.cores_to_leave(all_threads=2) == 1
    only_forward = CoreShare(1)
    only_forward.record_forward(10, 0.450, threads=2, all_threads=2)  # 45 ms a tile
    assert only_forward.cores_to_leave(all_threads=2) == 1
    # Once both are known, they decide.
    only_forward.record_decode(10, 0.014)
    assert only_forward.cores_to_leave(all_threads=2) == 0
    assert share_with(forward_ms=0.5, decode_ms=1.0).cores_to_leave(all_threads=2) == 1


def test_a_heavy_forward_pass_keeps_every_core() -> None:
    heavy = share_with(forward_ms=45.0, decode_ms=1.4)  # ViT-S on 2 cores
    assert heavy.cores_to_leave(all_threads=2) == 0
    # With 16 threads one core costs the pass a fifteenth: worth it while F <= 6 * 15 * D.
    assert share_with(forward_ms=6.0, decode_ms=1.4).cores_to_leave(16) == 1
    assert share_with(forward_ms=120.0, decode_ms=1.4).cores_to_leave(16) == 1
    assert share_with(forward_ms=130.0, decode_ms=1.4).cores_to_leave(16) == 0


def test_the_forward_pass_keeps_at_least_one_thread() -> None:
    assert share_with(0.1, 10.0, decode_threads=1).cores_to_leave(all_threads=1) == 0
    assert share_with(0.1, 10.0, decode_threads=8).cores_to_leave(all_threads=4) == 3


def test_forward_costs_are_normalized_to_every_thread_and_averaged() -> None:
    share = CoreShare(1)
    share.record_decode(1, 0.0011)
    # 6 ms a tile on 1 of 2 threads is 3 ms a tile on both: 3 <= 6 * 1.1, so leave a core.
    share.record_forward(10, 0.060, threads=1, all_threads=2)
    assert share.cores_to_leave(2) == 1
    for _ in range(30):  # then the passes get slow: the average follows
        share.record_forward(10, 0.100, threads=2, all_threads=2)
    assert share.cores_to_leave(2) == 0


def test_averages_weigh_each_call_by_its_tiles() -> None:
    share = CoreShare(1)
    share.record_decode(10, 0.012)
    share.record_forward(1, 0.034, threads=2, all_threads=2)  # a lone slow tile at a burst's start
    assert share.cores_to_leave(2) == 0  # 34 ms a tile so far
    share.record_forward(50, 0.060, threads=2, all_threads=2)  # then a batch: ~1.8 ms a tile
    assert share.cores_to_leave(2) == 1


def test_only_decode_chunks_of_queued_bodies_are_counted(tiny_model: ServerModel) -> None:
    share = CoreShare(1)
    _decode_chunk(tiny_model, share, [(body(0), "predict")])  # a lone body: an idle machine
    assert share._decode.per_tile() is None
    decoded = _decode_chunk(tiny_model, share, [(body(1), "predict"), ("{", "predict")])
    assert isinstance(decoded[1], InvalidRequestError)  # a refusal is returned, and counted
    per_tile = share._decode.per_tile()
    assert per_tile is not None and 0 < per_tile < 1.0


def test_a_body_decoded_while_the_device_runs_a_pass_is_counted(tiny_model: ServerModel) -> None:
    """At 2 in flight (or batch size 1) every chunk is one body; one that decodes while a pass
    runs is a loaded decode. Without it a heavy model's decode cost would stay unknown, and its
    loaded passes would leave a core for good."""
    share = CoreShare(1)
    busy, release = threading.Event(), threading.Event()

    def a_pass() -> None:
        busy.set()
        release.wait(30)

    device = device_thread(tiny_model.device)
    running = device.submit(a_pass)
    try:
        assert busy.wait(30)
        [decoded] = _decode_chunk(tiny_model, share, [(body(0), "predict")])
    finally:
        release.set()
        running.result(30)
    assert not isinstance(decoded, InvalidRequestError)
    per_tile = share._decode.per_tile()
    assert per_tile is not None and 0 < per_tile < 1.0
    # Known costs decide: a pass 45x a decode keeps every core.
    share.record_forward(10, 10 * 45 * per_tile, threads=2, all_threads=2)
    assert share.cores_to_leave(2) == 0


def test_unknown_costs_leave_at_most_half_the_threads() -> None:
    """4 decoders on a 4-core box: the first passes run on 2 threads, not on 1."""
    assert CoreShare(4).cores_to_leave(all_threads=4) == 2
    assert CoreShare(1).cores_to_leave(all_threads=4) == 1


def test_a_choice_to_keep_every_core_is_probed_again() -> None:
    """Only passes that leave cores teach the forward cost: while the answer is "none", one
    pass in _PROBE leaves anyway, so one slow measurement cannot keep the choice for good."""
    from histoinfer.clients import cores

    share = share_with(forward_ms=45.0, decode_ms=1.4)  # keeps every core
    answers = [share.cores_to_leave(2) for _ in range(3 * cores._PROBE)]
    assert answers.count(1) == 3 and answers[cores._PROBE - 1] == 1


def test_one_outlier_does_not_flip_the_choice() -> None:
    share = share_with(forward_ms=2.0, decode_ms=1.0)  # leaves: 2 <= 6 * 1
    share.record_forward(1, 0.500, threads=2, all_threads=2)  # one preempted pass: 500 ms
    assert share.cores_to_leave(2) == 1  # counted as 6 ms at most
    for _ in range(30):  # a lasting change still moves it
        share.record_forward(10, 0.500, threads=2, all_threads=2)
    assert share.cores_to_leave(2) == 0
