"""A decode node and a prefill node (threads of this process, each its own engine and Transfer
Engine, the real Redis broker): every split request gives the tokens a unified node gives, counts
as cached what no node computed, and leaves both nodes' free blocks at their baseline."""

from __future__ import annotations

import copy
import time

import dramatiq

from inference.node.node import Node
from inference.protocol.disagg import PrefillRequest
from inference.protocol.messages import (
    ABORT_ACTOR,
    PREFILL_ACTOR,
    control_queue,
    prefill_node_queue,
    prefill_queue,
)
from tests.disagg.nodes import (
    MODEL,
    collect_results,
    decode_node,
    enqueue,
    make_broker,
    make_engine,
    prefill_node,
    request,
    running,
)
from tests.waiting import wait_for

LONG = list(range(3, 203))  # 200 tokens in 13 blocks: 12 full, the 13th holds the last 8


def unified_results(model_dir, bodies: list[dict]) -> dict[str, dict]:
    """What a unified node answers to the same requests, not split."""
    broker = make_broker()
    try:
        for body in bodies:
            enqueue(broker, {**body, "prefill": None})
        node = Node(make_engine(model_dir), MODEL, "unified-1", broker)
        with running(node):
            return collect_results(broker, len(bodies))
    finally:
        broker.flush_all()
        broker.close()


def assert_same_output(split: dict, unified: dict) -> None:
    assert split["error"] is None, split["error"]
    assert split["token_ids"] == unified["token_ids"]
    assert split["text"] == unified["text"]
    assert split["usage"]["completion_tokens"] == unified["usage"]["completion_tokens"]
    assert split.get("choices") == unified.get("choices")


def wait_for_baseline(*engines) -> None:
    """Every engine's blocks free again (held blocks included, once their holds end)."""

    def at_baseline() -> bool:
        for engine in engines:
            engine.release_holds()
        return all(e.block_manager.num_free_blocks == e.block_manager.num_blocks for e in engines)

    wait_for(at_baseline, timeout_s=10, what="every block free again")


def fast_holds():
    return {"kv_wait_s": 2.0, "kv_hold_grace_s": 0.2}


def test_split_requests_match_unified_mode_token_for_token_and_count_what_no_node_computed(
    tiny_llama_dir, broker
):
    decode = decode_node(tiny_llama_dir, broker, max_num_batched_tokens=64, **fast_holds())
    prefill = prefill_node(tiny_llama_dir, broker, max_num_batched_tokens=48)  # chunked
    short = list(range(40, 75))
    bodies = {
        "long": request("long", LONG),
        "short": request("short", short),
        "n3": request(
            "n3",
            list(range(250, 400)) + [9] * 20,
            sampling={**request("x", [])["sampling"], "n": 3},
        ),
    }
    with running(decode, prefill):
        for body in bodies.values():
            enqueue(broker, body)
        first = collect_results(broker, len(bodies))
        # Second round: the decode node holds LONG's blocks (they were written into its cache),
        # the prefill node holds them too (its own cache kept them).
        both = request("both", LONG + [5] * 40)
        enqueue(broker, both)
        second = collect_results(broker, 1)
    unified = unified_results(tiny_llama_dir, [*bodies.values(), both])
    for request_id, result in {**first, **second}.items():
        assert_same_output(result, unified[request_id])
        assert result["prefill_node"] == "prefill-1" and result["node"] == "decode-1"
    assert first["long"]["usage"]["cached_tokens"] == 0
    # "both": the decode node held LONG's 12 full blocks; 240 tokens, blocks 12-13 came from the
    # prefill node, which also held... only LONG's 12: the hit is 192 either way.
    assert second["both"]["usage"]["cached_tokens"] == 192
    assert len(first["n3"]["choices"]) == 3
    stats = decode.remote.stats()
    assert stats["requests"] == 4 and stats["blocks_reused"] == 12 and stats["fallbacks"] == 0
    assert prefill.counters["requests"] == 4
    wait_for_baseline(decode.engine, prefill.engine)


def test_a_prefix_only_the_prefill_node_holds_counts_as_cached_once(tiny_llama_dir, broker):
    decode = decode_node(tiny_llama_dir, broker, **fast_holds())
    prefill = prefill_node(tiny_llama_dir, broker)
    # Warm the prefill node alone with LONG's prefix (a split whose decode node we restart).
    warm = decode_node(tiny_llama_dir, broker, node_id="decode-warm", **fast_holds())
    with running(warm, prefill):
        enqueue(broker, request("warm", LONG[:180]))
        collect_results(broker, 1)
    with running(decode, prefill):
        enqueue(broker, request("p", LONG))
        [result] = collect_results(broker, 1).values()
    # 11 full blocks of LONG[:180] were in the prefill node's cache: 176 tokens no node computed.
    assert result["usage"]["cached_tokens"] == 176
    assert_same_output(result, unified_results(tiny_llama_dir, [request("p", LONG)])["p"])
    wait_for_baseline(decode.engine, prefill.engine)


def test_structured_outputs_and_stop_conditions_run_the_same_split(tiny_llama_dir, broker):
    decode = decode_node(tiny_llama_dir, broker, **fast_holds())
    prefill = prefill_node(tiny_llama_dir, broker)
    sampling = {"temperature": 0.0, "max_tokens": 30, "structured": {"type": "json_object"}}
    body = request("json", LONG, sampling=sampling)
    with running(decode, prefill):
        enqueue(broker, body)
        [result] = collect_results(broker, 1).values()
    assert_same_output(result, unified_results(tiny_llama_dir, [body])["json"])
    assert result["prefill_node"] == "prefill-1"


def test_no_prefill_node_or_a_lost_prefill_message_ends_in_a_local_prefill_with_the_same_tokens(
    tiny_llama_dir, broker
):
    """The prefill message is taken off the queue and lost (a prefill node died with it): after
    kv_wait_s the decode node asks the shared prefill queue under epoch 2; nobody serves that one
    either, so it prefills the prompt itself."""
    decode = decode_node(tiny_llama_dir, broker, kv_wait_s=0.5, kv_hold_grace_s=0.2)
    queue = prefill_node_queue(MODEL, "prefill-1")
    broker.declare_queue(queue)
    broker.declare_queue(prefill_queue(MODEL))
    thief = broker.consume(queue, prefetch=1, timeout=100)
    shared = broker.consume(prefill_queue(MODEL), prefetch=1, timeout=100)
    with running(decode):
        enqueue(broker, request("lost", LONG))
        lost = wait_for(lambda: next(thief), timeout_s=10, what="the prefill message")
        thief.ack(lost)
        retry = wait_for(lambda: next(shared), timeout_s=10, what="the second attempt")
        shared.ack(retry)
        [result] = collect_results(broker, 1).values()
    thief.close()
    shared.close()
    assert lost.args[0]["epoch"] == 1 and retry.args[0]["epoch"] == 2
    assert set(lost.args[0]["block_ids"]).isdisjoint(retry.args[0]["block_ids"])
    assert result["prefill_node"] is None and decode.remote.stats()["fallbacks"] == 1
    assert_same_output(result, unified_results(tiny_llama_dir, [request("lost", LONG)])["lost"])
    wait_for_baseline(decode.engine)


def test_a_prefill_message_delivered_twice_writes_into_held_blocks_only_and_counts_once(
    tiny_llama_dir, broker
):
    decode = decode_node(tiny_llama_dir, broker, kv_wait_s=3.0, kv_hold_grace_s=0.2)
    prefill = prefill_node(tiny_llama_dir, broker)
    queue = prefill_node_queue(MODEL, "prefill-1")
    broker.declare_queue(queue)
    taker = broker.consume(queue, prefetch=1, timeout=100)
    with running(decode):
        enqueue(broker, request("twice", LONG))
        message = wait_for(lambda: next(taker), timeout_s=10, what="the prefill message")
        taker.ack(message)
        taker.close()
        for _ in range(2):  # the broker delivers it twice
            broker.enqueue(
                dramatiq.Message(
                    queue_name=queue,
                    actor_name=PREFILL_ACTOR,
                    args=(copy.deepcopy(message.args[0]),),
                    kwargs={},
                    options={},
                )
            )
        with running(prefill):
            [result] = collect_results(broker, 1).values()
            wait_for(lambda: prefill.counters["requests"] == 2, timeout_s=10, what="both copies")
    assert (
        decode.remote.stats()["requests"] == 1 and decode.remote.stats()["blocks_transferred"] == 13
    )
    assert_same_output(result, unified_results(tiny_llama_dir, [request("twice", LONG)])["twice"])
    wait_for_baseline(decode.engine, prefill.engine)


def test_a_late_prefill_message_is_dropped_without_computing_or_writing(tiny_llama_dir, broker):
    prefill = prefill_node(tiny_llama_dir, broker)
    decode_engine = make_engine(tiny_llama_dir)
    from inference.disagg.layout import kv_layout_of
    from inference.disagg.transfer import KVTransfer

    region = KVTransfer(decode_engine.runner.kv_buffer, kv_layout_of(decode_engine, MODEL)).region
    late = PrefillRequest(
        request_id="late",
        epoch=1,
        org="acme",
        token_ids=LONG[:192],
        first_block=0,
        block_ids=list(range(12)),
        deadline=time.time() - 1,
        reply_queue=control_queue(MODEL, "decode-x"),
        decode_node="decode-x",
        kv=region.as_dict(),
    )
    queue = prefill_queue(MODEL)
    broker.declare_queue(queue)
    broker.enqueue(
        dramatiq.Message(
            queue_name=queue,
            actor_name=PREFILL_ACTOR,
            args=(late.as_message(),),
            kwargs={},
            options={},
        )
    )
    before = decode_engine.runner.kv_buffer.clone()
    with running(prefill):
        wait_for(
            lambda: not broker.client.llen(f"{broker.namespace}:{queue}"),
            timeout_s=10,
            what="taken",
        )
        time.sleep(0.3)
    assert (
        prefill.counters["requests"] == 0 and prefill.engine.stats().prefix_cache_query_tokens == 0
    )
    assert decode_engine.runner.kv_buffer.equal(before)


def test_an_abort_while_the_kv_is_on_its_way_holds_the_blocks_until_the_write_deadline(
    tiny_llama_dir, broker
):
    decode = decode_node(tiny_llama_dir, broker, kv_wait_s=2.0, kv_hold_grace_s=0.2)
    prefill = prefill_node(tiny_llama_dir, broker)
    with running(decode):
        enqueue(broker, request("gone", LONG))
        wait_for(lambda: decode.engine.num_awaiting_kv == 1, timeout_s=10, what="awaiting KV")
        queue = control_queue(MODEL, "decode-1")
        broker.enqueue(
            dramatiq.Message(
                queue_name=queue,
                actor_name=ABORT_ACTOR,
                args=({"request_id": "gone"},),
                kwargs={},
                options={},
            )
        )
        [result] = collect_results(broker, 1).values()
        held = decode.engine.block_manager.num_held_blocks
    assert result["finish_reason"] == "abort" and held == 13
    # The prefill node now computes and writes it anyway: into the held blocks, and its
    # prefill_done changes nothing.
    enqueue(broker, request("next", list(range(300, 340)), prefill_to=None))
    with running(decode, prefill):
        [after] = collect_results(broker, 1).values()
        wait_for(lambda: prefill.counters["requests"] == 1, timeout_s=10, what="the late write")
    assert after["error"] is None
    wait_for_baseline(decode.engine, prefill.engine)


def test_a_prefill_node_of_another_layout_is_refused_and_the_request_prefilled_here(
    tiny_llama_dir, broker
):
    decode = decode_node(tiny_llama_dir, broker, **fast_holds())
    prefill = prefill_node(tiny_llama_dir, broker, block_size=8)
    with running(decode, prefill):
        enqueue(broker, request("mixed", LONG))
        [result] = collect_results(broker, 1).values()
    assert result["prefill_node"] is None and decode.remote.stats()["fallbacks"] == 1
    assert prefill.counters["requests"] == 0
    assert_same_output(result, unified_results(tiny_llama_dir, [request("mixed", LONG)])["mixed"])
    wait_for_baseline(decode.engine)


def test_a_decode_node_without_blocks_for_a_split_request_leaves_it_in_the_broker(
    tiny_llama_dir, broker
):
    """decode-1 has 20 blocks: LONG's 13 (prompt and max_tokens) fit once. While they are taken
    (and then held until the write deadline), the second request stays in the broker, where
    decode-2 takes it."""
    small = decode_node(
        tiny_llama_dir, broker, num_kv_blocks=20, kv_wait_s=3.0, kv_hold_grace_s=0.2
    )
    prefill = prefill_node(tiny_llama_dir, broker)
    enqueue(broker, request("a", LONG))
    enqueue(broker, request("b", [7, *LONG[1:]]))
    queue_key = f"{broker.namespace}:infer.{MODEL}"
    with running(small, prefill):
        [first] = collect_results(broker, 1).values()
        assert broker.client.llen(queue_key) == 1  # the other, given back
        assert small.engine.num_waiting == 0
    other = decode_node(tiny_llama_dir, broker, node_id="decode-2", **fast_holds())
    with running(small, other, prefill):
        [second] = collect_results(broker, 1).values()
    assert {first["request_id"], second["request_id"]} == {"a", "b"}
    assert (first["node"], second["node"]) == ("decode-1", "decode-2")
    assert second["prefill_node"] == "prefill-1"
    wait_for_baseline(small.engine, other.engine, prefill.engine)
