"""End to end on SGLang's real server: plugin and stock side by side at TP=2.

Both servers run `hicache-async-ack-lab cpu-server` (SGLang's launch_server, real
scheduler loop, cache controller, host pool and HTTP API) with write-through,
the overlap loop, a file storage backend and skewed acks (rank 1's finish
events report done three polls after rank 0's, as on a GPU host), and are
driven with the same requests over HTTP. The bundled model's seeded weights make
every answer depend on the whole prompt, so comparing greedy tokens and their
logprobs checks the KV that came back from host or storage (the negative control,
test_negative_control.py, shows these very checks failing on broken copies).
"""

from __future__ import annotations

import pytest

from support.e2e_servers import (
    RESENT,
    SEQUENCE,
    STOCK_ENV,
    STORAGE_ARGS,
    ask,
    ask_together,
    assert_cache_dependent,
    assert_same,
    compare,
    flush_and_resend,
    metric_samples,
    popped_by_rank,
    prompts,
    run_sequence,
    serve,
    settled,
    storage_env,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def plugin_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plugin")
    yield from serve(tmp, "plugin", STORAGE_ARGS, env=storage_env(tmp), skew="0,3")


@pytest.fixture(scope="module")
def stock_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stock")
    env = {**STOCK_ENV, **storage_env(tmp)}
    yield from serve(tmp, "stock", STORAGE_ARGS, env=env, skew="0,3")


@pytest.fixture(scope="module")
def sequences(plugin_server, stock_server):
    return {"plugin": run_sequence(plugin_server), "stock": run_sequence(stock_server)}


def servers(plugin_server, stock_server) -> dict:
    return {"plugin": plugin_server, "stock": stock_server}


def test_each_rank_logs_its_path(plugin_server, stock_server):
    log = plugin_server.log()
    for rank in (0, 1):
        assert f"TP{rank}] HiCache ack sync: pipelined over the one attn TP group" in log
    stock = stock_server.log()
    assert "Load weight end" in stock  # a log that is the server's, not an empty file
    assert "HiCache ack sync: pipelined" not in stock


def test_answers_depend_on_the_whole_prompt(plugin_server, sequences):
    # Not dummy weights (every logprob -ln(512), the reply decided by the last token):
    # a different first word, 30 words back, moves the logprobs.
    assert_cache_dependent(sequences["plugin"])
    first = SEQUENCE[0]
    other = " ".join(["omega" if first.split()[0] != "omega" else "alpha", *first.split()[1:]])
    changed = compare([sequences["plugin"][0]], [ask(plugin_server, other)])
    assert changed.mismatches, f"a different first word changed nothing: {changed}"


def test_answers_match_a_reference_forward_of_the_same_weights(sequences):
    # A client of its own: transformers' Llama on the model directory, in this process.
    # The server's first answers (prefills; a shared first word or two may come from
    # the device) must be the weights' answers.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hicache_async_ack_lab.cpu_server.model import ensure_model

    path = str(ensure_model())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    served = sequences["plugin"][:RESENT]
    assert served
    assert all(r.restored == 0 for r in served), served
    for text, reply in zip(SEQUENCE[:RESENT], served):
        ids = tok(text, return_tensors="pt")["input_ids"]
        tokens, logprobs = [], []
        with torch.no_grad():
            for _ in range(len(reply.tokens)):
                logp = torch.log_softmax(model(ids).logits[0, -1], -1)
                nxt = int(logp.argmax())
                tokens.append(nxt)
                logprobs.append(float(logp[nxt]))
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        assert tuple(tokens) == reply.tokens, (text, tokens, reply.tokens)
        diff = max(abs(a - b) for a, b in zip(logprobs, reply.logprobs))
        print(f"reference vs served: max logprob diff {diff:.2e}")
        assert diff <= 1e-4, diff  # e2e_servers.LOGPROB_TOL's reasoning: kernels' order only


def test_plugin_and_stock_give_the_same_tokens_and_logprobs(sequences):
    # Same weights, same requests: the same tokens and logprobs, whether a prefix was
    # computed, kept on device, or loaded back from host (which of those happens
    # depends on copy timing, on either server).
    assert_same(sequences["stock"], sequences["plugin"])


@pytest.mark.parametrize("name", ["plugin", "stock"])
def test_resent_prompts_restored_from_host_give_the_first_answers(name, sequences):
    seq = sequences[name]
    first, resent = seq[:RESENT], seq[len(SEQUENCE) :]
    assert len(resent) == RESENT
    assert any(r.host > 0 for r in resent), f"{name}: no host hit in {resent}"
    assert_same(first, resent)


def test_metrics_pipelined_on_every_rank_and_entries_popped(plugin_server, sequences):
    pipelined = metric_samples(plugin_server, "sglang:hicache_ack_sync_pipelined")
    assert sorted(s.labels["tp_rank"] for s in pipelined) == ["0", "1"]
    assert all(s.value == 1.0 for s in pipelined)
    by_rank = popped_by_rank(plugin_server, 2)
    assert set(by_rank) == {"0", "1"}
    # The group's agreement pops the same entries on every rank.
    assert by_rank["0"] == by_rank["1"]
    writes = sum(v for q, v in by_rank["0"].items() if "write" in q)
    loads = sum(v for q, v in by_rank["0"].items() if "load" in q)
    assert writes > 0 and loads > 0, by_rank
    failures = metric_samples(plugin_server, "sglang:hicache_ack_sync_failures_total")
    failures = [s for s in failures if s.name.endswith("_total")]
    # Exported at 0 from the start, per rank and reason: an empty list would be a
    # missing series, not the absence of failures.
    assert {s.labels["tp_rank"] for s in failures} == {"0", "1"}, failures
    assert all(s.value == 0 for s in failures), failures


def test_stock_exposes_no_pipelined_rank(plugin_server, stock_server, sequences):
    # Disabled, the plugin registers no hooks, so it exports no series at all: the
    # stock server's /metrics has SGLang's own families but not the plugin's, which
    # the plugin server (same scrape, same parser) does export.
    name = "sglang:hicache_ack_sync_pipelined"
    assert len(metric_samples(plugin_server, name)) == 2
    assert metric_samples(stock_server, "sglang:num_running_reqs"), "no SGLang metrics at all"
    assert metric_samples(stock_server, name) == []


@pytest.mark.parametrize("name", ["plugin", "stock"])
def test_flushed_prompts_restored_from_storage_give_the_first_answers(
    name, plugin_server, stock_server, sequences
):
    # Several at once: their storage prefetches are in flight together, so the
    # prefetch termination decisions cover more than one operation per pass.
    replies = flush_and_resend(servers(plugin_server, stock_server)[name])
    assert any(r.storage > 0 for r in replies), [r.storage for r in replies]
    assert_same(sequences[name][:RESENT], replies)


def test_prefetch_votes_pipelined_and_voted_on_the_storage_prefetches(plugin_server):
    # After the storage test: several prefetches were in flight under the default
    # timeout policy, decided by one vote reduce per pass instead of one blocking
    # reduce per waiting request.
    log = plugin_server.log()
    for rank in (0, 1):
        assert f"TP{rank}] HiCache prefetch votes: pipelined" in log
    name = "sglang:hicache_prefetch_votes_operations_total"
    voted = settled(
        lambda: {s.labels["tp_rank"]: s.value for s in metric_samples(plugin_server, name)}, 2
    )
    assert set(voted) == {"0", "1"} and voted["0"] == voted["1"] > 0, voted


@pytest.mark.parametrize("name", ["plugin", "stock"])
def test_flush_cache_over_http_while_requests_in_flight(name, plugin_server, stock_server):
    import threading

    server = servers(plugin_server, stock_server)[name]
    burst = prompts(12, seed=7)
    answers: list = []
    done = threading.Thread(
        target=lambda: answers.extend(ask_together(server, burst, max_new_tokens=16))
    )
    done.start()
    flushes = []
    for _ in range(3):  # refused while busy, or done: both are fine, never a hang
        try:
            flushes.append(server.post("/flush_cache?timeout=5"))
        except Exception as exc:  # noqa: BLE001 - HTTP 400 means "not performed"
            flushes.append(exc)
    done.join(timeout=600)
    assert len(answers) == len(burst), "the burst did not finish"
    assert all(len(r.tokens) == 16 for r in answers)
    # Still serving, and a quiet flush now succeeds.
    assert b"Cache flushed" in server.post("/flush_cache?timeout=30")
    # The answers given around the flushes are the weights' answers: asked again one
    # by one (recomputed, or from storage), the same tokens and logprobs.
    again = [ask(server, text, max_new_tokens=16) for text in burst[:4]]
    assert_same(answers[:4], again, restored=False)
    assert not server.exited()
