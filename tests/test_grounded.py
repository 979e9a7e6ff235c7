"""Answers a person can trust, on a stack as shipped (calibrated relevance gate, answer cache on) with the
real hybrid retrieval; only the language models are scripted: the configured one and a fallback."""

from __future__ import annotations

import json

import pytest

import httpx
from prometheus_client.parser import text_string_to_metric_families

from activities.chat import REPETITION_WARNING
from devtools.scripted_llm import ScriptedLLM
from ragline.prompts import no_documents_warning
from tests.conftest import running_stack, worker_metrics_url
from tests.helpers import eventually, read_events

POSTMORTEM = (
    "Postmortem of incident 4711. The root cause of incident 4711 was an expired TLS certificate on the "
    "internal payment gateway proxy. The renewal job had failed for three weeks because its service account "
    "lost write permission to the secrets vault. About 12,400 orders failed during the outage.")
HANDBOOK = (
    "平台运维手册\n\n第二章 大模型服务\n\n单次大模型调用的超时阈值为45秒，超过45秒的调用会被中断并按重试策略重试。"
    "每个请求最多重试3次，重试间隔从2秒开始，每次翻倍。\n\n第四章 数据备份\n\n数据库每天凌晨两点进行全量备份，备份文件保留35天。")


@pytest.fixture(scope="module")
async def light_llm():
    llm = ScriptedLLM()
    await llm.start()
    yield llm
    await llm.stop()


@pytest.fixture(scope="module")
async def primary_llm():
    llm = ScriptedLLM()
    await llm.start()
    yield llm
    await llm.stop()


@pytest.fixture(scope="module")
async def trusted(temporal_env, primary_llm, light_llm, tmp_path_factory):
    address = temporal_env.client.service_client.config.target_host
    async with running_stack(address, primary_llm, tmp_path_factory.mktemp("grounded"), task_queue="ragline-grounded",
                             relevance_threshold=None, answer_cache_size=64,
                             fallback_llm_base_url=light_llm.base_url, fallback_llm_model="light") as stack:
        body = await stack.upload(("postmortem.txt", POSTMORTEM.encode()), ("handbook-zh.txt", HANDBOOK.encode()),
                                  collection="trust")
        assert (await stack.wait_job(body["job_id"]))["status"] == "completed"
        yield stack


async def ask(stack, question: str, collection: str = "trust") -> dict:
    job = await stack.wait_job((await stack.chat(question, collection=collection))["job_id"])
    assert job["status"] == "completed", job
    return job


async def test_out_of_corpus_question_is_refused_honestly_in_its_language_without_a_model_call(trusted):
    before = trusted.llm.count()
    en = (await ask(trusted, "What is the capital of Australia?"))["result"]
    zh = (await ask(trusted, "澳大利亚的首都是哪里？"))["result"]
    assert en["supported"] is False and en["citations"] == [] and "do not cover" in en["answer"]
    assert zh["supported"] is False and zh["citations"] == [] and "没有涉及" in zh["answer"]
    assert trusted.llm.count() == before  # no generation, no summary, no entities


async def test_a_collection_without_documents_is_named_instead_of_a_plain_i_dont_know(trusted):
    """A misspelt collection ("handbok"): the refusal says the collection has no documents, in the
    question's language, with a warning; it is not kept, so documents uploaded next are answered from."""
    before = trusted.llm.count()
    en = await ask(trusted, "What was the root cause of incident 4711?", collection="handbok")
    zh = await ask(trusted, "单次大模型调用的超时阈值是多少秒？", collection="handbok")
    assert trusted.llm.count() == before  # nothing to retrieve: no model call
    for job, says in ((en, '"handbok" has no searchable documents'), (zh, "“handbok”中没有可检索的文档")):
        result = job["result"]
        assert result["supported"] is False and result["citations"] == [] and says in result["answer"]
        assert result["warnings"] == [no_documents_warning("handbok")] and "handbok" in result["warnings"][0]
        assert "cache_answer" not in [s["name"] for s in job["steps"]]
    again = await ask(trusted, "What was the root cause of incident 4711?", collection="handbok")
    assert again["result"]["cached"] is False and again["result"]["warnings"] == en["result"]["warnings"]
    # Uploaded a moment later: the same question is answered from the documents.
    body = await trusted.upload(("postmortem.txt", POSTMORTEM.encode()), collection="handbok")
    assert (await trusted.wait_job(body["job_id"]))["status"] == "completed"
    trusted.llm.script("answer", ["An expired TLS certificate [1]."])
    answered = (await ask(trusted, "What was the root cause of incident 4711?", collection="handbok"))["result"]
    assert answered["supported"] is True and answered["warnings"] == [] and answered["citations"]


async def test_a_search_on_a_collection_without_documents_says_so(trusted):
    r = await trusted.http.post("/v1/search", json={"query": "database backups", "collection": "handbok-typo"})
    assert r.status_code == 200, r.text
    assert r.json() == {"hits": [], "warnings": [no_documents_warning("handbok-typo")]}
    r = await trusted.http.post("/v1/search", json={"query": "database backups", "collection": "trust"})
    assert r.json()["hits"] and r.json()["warnings"] == []


async def test_another_tenants_documents_do_not_count_as_documents(trusted):
    """Collection "trust" holds acme's documents only: for globex it has none, and says so."""
    r = await trusted.other_http.post("/v1/chats", json={"message": "What was the root cause of incident 4711?",
                                                          "collection": "trust"})
    assert r.status_code == 202, r.text

    async def ended() -> dict | None:
        job = (await trusted.other_http.get(f"/v1/jobs/{r.json()['job_id']}")).json()
        return job if job["status"] not in ("queued", "running") else None

    job = await eventually(ended, timeout=120, what="globex's turn ended")
    assert job["status"] == "completed", job
    assert job["result"]["supported"] is False and '"trust" has no searchable documents' in job["result"]["answer"]
    assert job["result"]["warnings"] == [no_documents_warning("trust")]
    search = await trusted.other_http.post("/v1/search", json={"query": "incident 4711", "collection": "trust"})
    assert search.json() == {"hits": [], "warnings": [no_documents_warning("trust")]}


async def test_a_looping_answer_is_cut_and_not_kept_for_the_next_asker(trusted):
    question = "About how many orders failed in incident 4711?"
    answer = "About 12,400 orders failed [1]."
    trusted.llm.script("answer", [f"{answer} {'[1] [2] ' * 100}"])
    calls = trusted.llm.count("answer")
    looped = (await ask(trusted, question))["result"]
    assert looped["answer"] == f"{answer} [1] [2]" and REPETITION_WARNING in looped["warnings"]
    trusted.llm.script("answer", [answer])
    again = (await ask(trusted, question))["result"]
    assert again["cached"] is False and again["answer"] == answer and again["warnings"] == []
    assert trusted.llm.count("answer") == calls + 2


async def test_chinese_answer_cites_the_handbook_with_page_and_quoted_span(trusted):
    trusted.llm.script("answer", ["45"])  # the bare, uncited number the issue saw from the local model
    job = await ask(trusted, "单次大模型调用的超时阈值是多少秒？")
    result = job["result"]
    assert result["supported"] is True and result["answer"] == "45"
    [cited] = [c for c in result["citations"] if c["filename"] == "handbook-zh.txt"]
    assert cited["page"] == 1 and "45秒" in cited["quote"] and 0 < cited["relevance"] <= 1


async def test_an_uncited_answer_nothing_supports_is_flagged(trusted):
    trusted.llm.script("answer", ["Canberra is lovely in autumn."])
    result = (await ask(trusted, "What went wrong with the payment gateway certificate?"))["result"]
    assert result["supported"] is False and result["citations"] == []
    assert any("unverified" in w for w in result["warnings"])


@pytest.mark.parametrize("reply, told", [
    ("[1] [2]", 'the model replied with citation markers only ("[1] [2]") and no words'),
    ("[1", 'the model replied with citation markers only ("[1") and no words'),
    ("", "the model's reply had no words"),
])
async def test_an_answer_with_no_words_of_its_own_is_not_passed_on_as_one(trusted, reply, told):
    """What a small local model sometimes returns: citation marks, a cut-off mark, nothing. The warning
    says what came instead of an answer; "unverified" would suggest there was an answer to check."""
    trusted.llm.script("answer", [reply])
    question = f"What was the root cause of incident 4711? ({len(reply)})"
    result = (await ask(trusted, question))["result"]
    assert result["supported"] is False and result["citations"] == []
    assert result["answer"].startswith("The model gave no usable answer")
    [warning] = result["warnings"]
    assert warning.startswith(told) and "unverified" not in warning
    # Not kept for the next asker: the same question goes to the model again.
    calls = trusted.llm.count("answer")
    trusted.llm.script("answer", ["An expired TLS certificate [1]."])
    assert (await ask(trusted, question))["result"]["answer"] == "An expired TLS certificate [1]."
    assert trusted.llm.count("answer") == calls + 1


async def test_a_turn_without_an_answer_is_not_the_next_turns_history(trusted):
    """The walkthrough's session: the placeholder for a reply with no words became the next turn's
    history, and the small model said it again, as its own unverified answer."""
    trusted.llm.script("answer", ["[1]"])
    first = await trusted.chat("What was the root cause of incident 4711? (history)", collection="trust")
    placeholder = (await trusted.wait_job(first["job_id"]))["result"]
    assert placeholder["answer"].startswith("The model gave no usable answer")
    assert placeholder.get("answered") is False  # a turn that says why there is no answer says so
    second = await trusted.chat("And how many orders failed?", session_id=first["session_id"], collection="trust")
    assert (await trusted.wait_job(second["job_id"]))["status"] == "completed"
    later = next(c for c in trusted.llm.calls if c.task == "answer" and c.question.startswith("And how many orders"))
    conversation = later.user_message.split("CONVERSATION SO FAR:", 1)[1].split("QUESTION:", 1)[0]
    assert "no usable answer" not in conversation and "incident 4711? (history)" not in conversation


async def test_a_refusal_held_for_review_is_not_cached_before_it(trusted):
    """A held refusal used to be cached at once: rejected by a reviewer, it was still served to the next
    asker of the same question, from the cache."""
    question = "What is the capital of Australia? (held)"
    r = await trusted.http.post("/v1/chats", json={"message": question, "collection": "trust", "require_review": True})
    held = await trusted.wait_job(r.json()["job_id"])
    assert held["status"] == "waiting_review" and held["result"] is None
    assert "cache_answer" not in {s["name"] for s in held["steps"] if s["status"] == "completed"}
    decided = await trusted.http.post(f"/v1/jobs/{held['job_id']}/review", json={"decision": "reject", "reviewer": "ana"})
    assert decided.status_code == 200, decided.text
    assert (await trusted.wait_done(held["job_id"]))["status"] == "failed"
    again = (await ask(trusted, question))["result"]
    assert again["cached"] is False and again["supported"] is False


async def test_cross_lingual_question_finds_the_chinese_handbook(trusted):
    hits = await trusted.search("How long are database backups kept?", collection="trust", top_k=1)
    assert hits[0]["filename"] == "handbook-zh.txt"
    hits = await trusted.search("4711号事故的根本原因是什么？", collection="trust", top_k=1)
    assert hits[0]["filename"] == "postmortem.txt"


async def _cache_lookups(stack) -> dict[str, float]:
    """This stack's answer cache lookups by result, from the worker's metrics (its task queues only)."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(worker_metrics_url())).text
    counts = {"hit": 0.0, "miss": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "ragline_answer_cache_lookups_total" and \
                    sample.labels.get("task_queue", "").startswith(stack.settings.task_queue):
                counts[sample.labels["result"]] += sample.value
    return counts


async def test_repeat_question_is_served_from_the_cache_until_the_collection_changes(trusted):
    question = "What was the root cause of incident 4711?"
    lookups = await _cache_lookups(trusted)
    body = await trusted.upload(("postmortem.txt", POSTMORTEM.encode()), collection="cache")
    assert (await trusted.wait_job(body["job_id"]))["status"] == "completed"
    answers = trusted.llm.count("answer")
    miss = await ask(trusted, question, collection="cache")
    assert miss["result"]["cached"] is False and "4711" in miss["result"]["answer"]
    assert trusted.llm.count("answer") == answers + 1
    hit = await ask(trusted, "  what was the ROOT cause of incident 4711 ", collection="cache")
    assert hit["result"]["cached"] is True and hit["result"]["answer"] == miss["result"]["answer"]
    assert hit["result"]["citations"] == miss["result"]["citations"] and hit["result"]["citations"]
    assert trusted.llm.count("answer") == answers + 1  # no model call
    assert {s["name"]: s["status"] for s in hit["steps"]}["generate_answer"] == "skipped"
    # Asked with another number of passages (top_k), it is answered from them, not from the cache.
    fewer = await trusted.wait_job((await trusted.chat(question, collection="cache", top_k=1))["job_id"])
    assert fewer["status"] == "completed" and fewer["result"]["cached"] is False, fewer
    assert trusted.llm.count("answer") == answers + 2
    # An upload into the collection makes a new version: the next ask is a miss again.
    body = await trusted.upload(("more.txt", b"Incident 4712 was a full disk on the build server."), collection="cache")
    assert (await trusted.wait_job(body["job_id"]))["status"] == "completed"
    again = await ask(trusted, question, collection="cache")
    assert again["result"]["cached"] is False and trusted.llm.count("answer") == answers + 3
    # Operators see the same on the worker's metrics: three misses and a hit.
    after = await _cache_lookups(trusted)
    assert (after["hit"] - lookups["hit"], after["miss"] - lookups["miss"]) == (1, 3)


async def test_a_cached_answer_goes_with_the_document_it_cites(trusted):
    """A removed document is cited by no answer, not even one the cache kept from before its removal."""
    question = "Who found the failed migration of incident 5120?"
    body = await trusted.upload(("incident.txt", b"Incident 5120: the failed migration was found by Priya, "
                                                 b"the on-call engineer, at 03:10."), collection="cache-removal")
    assert (await trusted.wait_job(body["job_id"]))["status"] == "completed"
    doc_id = body["documents"][0]["document_id"]
    assert (await ask(trusted, question, collection="cache-removal"))["result"]["cached"] is False
    hit = (await ask(trusted, question, collection="cache-removal"))["result"]
    assert hit["cached"] is True and [c["document_id"] for c in hit["citations"]] == [doc_id]
    r = await trusted.http.delete(f"/v1/documents/{doc_id}")
    assert r.status_code == 202, r.text
    assert (await trusted.wait_done(r.json()["job_id"]))["status"] == "completed"
    after = (await ask(trusted, question, collection="cache-removal"))["result"]
    assert after["cached"] is False and after["citations"] == [], after


async def test_the_fallback_model_answers_when_the_configured_one_keeps_failing(trusted, light_llm):
    """... and its answer streams under an attempt after the configured model's four (the first of which sent
    a piece before its stream broke): it was attempt 1 again, and a client that starts the answer over when
    the attempt changes showed the fallback's answer after that piece."""
    trusted.llm.script("answer", ["malformed"] + ["503"] * 3)  # generate_answer's every attempt (fast policies: 4)
    job = await ask(trusted, "How many orders failed during the outage?")
    result = job["result"]
    assert result["fallback_model"] == "light" and result["model"] == "light"
    assert any("fallback" in w for w in result["warnings"]) and result["citations"]
    assert light_llm.count("answer", ok_only=True) == 1
    deltas = [e["data"] for _, e in await read_events(trusted, job["job_id"]) if e["type"] == "ragline.answer.delta"]
    assert deltas[0]["attempt"] == 1 and {d["attempt"] for d in deltas[1:]} == {5}, deltas
    assert "".join(d["text"] for d in deltas[1:]).strip() == result["answer"]


async def test_a_turn_is_dead_lettered_only_when_the_fallback_fails_too(trusted, light_llm):
    trusted.llm.script("answer", ["503"] * 4)
    light_llm.script("answer", ["503"] * 2)  # generate_answer_fallback's attempts (fast policies: 2)
    accepted = await trusted.chat("Why did the renewal job fail for three weeks?", collection="trust")
    job = await trusted.wait_job(accepted["job_id"])
    assert job["status"] == "dead_lettered", job
    steps = {s["name"]: s["status"] for s in job["steps"]}
    assert steps["generate_answer"] == "failed"
    r = await trusted.http.post(f"/v1/jobs/{accepted['job_id']}/discard", json={"operator": "t", "reason": "test"})
    assert r.status_code == 200, r.text


async def test_a_fallback_that_refuses_parks_the_answer_for_an_operator_rather_than_failing_the_turn(
        trusted, light_llm):
    """The configured model is down (503s, a parkable outage) and the lighter fallback refuses the request
    (400: a smaller context, a wrong key). The turn used to fail with the fallback's refusal: no retry once the
    outage is over. It waits for an operator now, saying both, and a retry asks the configured model again."""
    trusted.llm.script("answer", ["503"] * 4)  # generate_answer's every attempt (fast policies: 4)
    light_llm.script("answer", ["400"])
    accepted = await trusted.chat("Which proxy had the expired TLS certificate in incident 4711?", collection="trust")
    job = await trusted.wait_job(accepted["job_id"])
    assert job["status"] == "dead_lettered", job
    steps = {s["name"]: s for s in job["steps"]}
    assert steps["generate_answer"]["status"] == "dead_lettered"
    assert steps["generate_answer_fallback"]["status"] == "failed"
    assert "503" in job["error"]["message"] and "the fallback refused too" in job["error"]["message"], job["error"]
    r = await trusted.http.post(f"/v1/jobs/{accepted['job_id']}/retry", json={"operator": "t", "reason": "back up"})
    assert r.status_code == 200, r.text
    job = await trusted.wait_job(accepted["job_id"], until=("completed", "failed", "cancelled"))
    assert job["status"] == "completed" and job["result"]["model"] != "light", job


async def test_evaluation_job_reports_recall_mrr_and_honest_refusals_per_collection(trusted):
    golden = "\n".join([
        '{"question": "What was the root cause of incident 4711?", "expected_document": "postmortem.txt", '
        '"expected_answer": "4711"}',
        '{"question": "单次大模型调用的超时阈值是多少秒？", "expected_document": "handbook-zh.txt"}',
        '{"question": "How long are database backups kept?", "expected_document": "handbook-zh.txt"}',
        '{"question": "What is the capital of Australia?", "expected_document": null}'])
    r = await trusted.http.post("/v1/evaluations?collection=trust&answers=true", content=golden.encode())
    assert r.status_code == 202, r.text
    job = await trusted.wait_job(r.json()["job_id"])
    assert job["status"] == "completed" and job["kind"] == "evaluation", job

    async def listed() -> dict | None:
        evaluations = (await trusted.http.get("/v1/evaluations?collection=trust")).json()["evaluations"]
        mine = [e for e in evaluations if e["job_id"] == r.json()["job_id"]]
        assert len(mine) <= 1, mine
        return mine[0] if mine and mine[0]["status"] == "completed" and mine[0]["report"] else None

    report = (await eventually(listed, what="the evaluation listed as completed, with its report"))["report"]
    # The listing pages through with a cursor, as every listing does: each evaluation once.
    second = await trusted.http.post("/v1/evaluations?collection=trust", content=golden.splitlines()[-1].encode())
    assert second.status_code == 202, second.text

    async def paged() -> list[str] | None:
        ids, cursor = [], None
        while True:
            page = await trusted.http.get("/v1/evaluations", params={"collection": "trust", "limit": 1,
                                                                      **({"cursor": cursor} if cursor else {})})
            assert page.status_code == 200 and len(page.json()["evaluations"]) <= 1, page.text
            ids += [e["job_id"] for e in page.json()["evaluations"]]
            if (cursor := page.json()["next_cursor"]) is None:
                break
        assert len(ids) == len(set(ids)), ids
        # Visibility lists a job a moment after its start: the second may not be listed at once.
        return ids if {r.json()["job_id"], second.json()["job_id"]} <= set(ids) else None

    await eventually(paged, what="both evaluations listed, each once")
    assert report["warnings"] == []
    # A misspelt expected document, or a collection without the tenant's documents, is told, not only scored.
    typo = await trusted.http.post("/v1/evaluations?collection=trust", content=b'{"question": "What was the root '
                                   b'cause of incident 4711?", "expected_document": "postmortem-typo.txt"}')
    empty = await trusted.http.post("/v1/evaluations?collection=nothing-here", content=golden.splitlines()[0].encode())
    typo_job, empty_job = [await trusted.wait_job(x.json()["job_id"]) for x in (typo, empty)]
    [warning] = typo_job["result"]["report"]["warnings"]
    assert "postmortem-typo.txt" in warning and "trust" in warning, warning
    [warning] = empty_job["result"]["report"]["warnings"]
    assert "nothing-here" in warning, warning
    assert report["questions"] == 4 and report["in_corpus"] == 3 and report["out_of_corpus"] == 1
    assert report["recall_at_k"] == 1.0 and report["mrr"] == 1.0 and report["honest_refusals"] == 1.0
    # The scripted model always cites passage [1]; answers are scored only where an expected answer is given.
    assert report["citation_correctness"] is not None and report["answer_accuracy"] == 1.0
    # The evaluation itself shows each question's outcome: what to look at when a number is low.
    one = (await trusted.http.get(f"/v1/evaluations/{r.json()['job_id']}")).json()
    outcomes = {o["question"]: o for o in one["report"]["outcomes"]}
    assert len(outcomes) == 4 and one["report"]["recall_at_k"] == 1.0
    incident = outcomes["What was the root cause of incident 4711?"]
    assert incident["rank"] == 1 and incident["top"][0] == "postmortem.txt" and incident["answer_correct"] is True
    assert outcomes["What is the capital of Australia?"]["supported"] is False
    assert (await trusted.other_http.get(f"/v1/evaluations/{r.json()['job_id']}")).status_code == 404
    for body, says in [(b'{"expected_document": "x"}', "line 1: question: Field required"),
                       (b'{"question": "q", "expected_doc": "x"}', "line 1: expected_document: Field required"),
                       (b'{"question": "q", "expected_document": "x", "expected_answr": "y"}',
                        "line 1: expected_answr: Extra inputs are not permitted"),
                       (b'{"question": "q", "expected_document": null}\n' + b"[" * 100_000, "line 2: nested too deeply")]:
        bad = await trusted.http.post("/v1/evaluations?collection=trust", content=body)
        assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_golden_set", bad.text
        assert says in bad.json()["error"]["message"], bad.text


async def test_a_retried_evaluation_goes_on_after_the_answers_it_already_has(trusted):
    """The model fails on the third golden question: the retried attempt asks only that one again,
    not the two it had answered (and paid for) already."""
    questions = ["Which certificate expired in incident 4711?", "How many orders failed during the outage?",
                 "Why did the renewal job fail?"]
    golden = "\n".join(json.dumps({"question": q, "expected_document": "postmortem.txt"}) for q in questions)
    trusted.llm.script("answer", ["The TLS certificate of the gateway proxy [1].", "About 12,400 [1].", "503"])
    before = len(trusted.llm.calls_for("answer", step="evaluate"))
    r = await trusted.http.post("/v1/evaluations?collection=trust&answers=true", content=golden.encode())
    job = await trusted.wait_job(r.json()["job_id"])
    assert job["status"] == "completed", job
    asked = [c.question for c in trusted.llm.calls_for("answer", step="evaluate")[before:]]
    assert asked == [*questions, questions[2]]


async def test_an_operators_retry_of_a_parked_evaluation_goes_on_after_the_answers_it_already_has(trusted):
    """The model fails on the third golden question until the step parks; an operator retries it once the
    model is back: the retry asks only that question, not the two answered (and paid for) before."""
    questions = ["Which certificate expired in incident 4711?", "How many orders failed during the outage?",
                 "Why did the renewal job fail?"]
    golden = "\n".join(json.dumps({"question": q, "expected_document": "postmortem.txt"}) for q in questions)
    attempts = 2  # evaluate_collection's in tests/fast_policies.toml
    trusted.llm.script("answer", ["The TLS certificate of the gateway proxy [1].", "About 12,400 [1].",
                                  *["503"] * attempts, "The renewal cron job lacked DNS access [1]."])
    before = len(trusted.llm.calls_for("answer", step="evaluate"))
    r = await trusted.http.post("/v1/evaluations?collection=trust&answers=true", content=golden.encode())
    job_id = r.json()["job_id"]
    assert (await trusted.wait_job(job_id))["status"] == "dead_lettered"
    retried = await trusted.http.post(f"/v1/jobs/{job_id}/retry", json={})
    assert retried.status_code == 200, retried.text
    job = await trusted.wait_done(job_id)
    assert job["status"] == "completed", job
    asked = [c.question for c in trusted.llm.calls_for("answer", step="evaluate")[before:]]
    assert asked == [*questions, *[questions[2]] * attempts]
    report = (await trusted.http.get(f"/v1/evaluations/{job_id}")).json()["report"]
    assert len(report["outcomes"]) == 3 and report["answer_accuracy"] is None


async def test_a_follow_up_that_names_its_topic_only_in_the_turn_before_is_answered(trusted):
    """"What caused it?" alone matches nothing; after "What happened in incident 4711?" it means the
    incident, and retrieval reads it so (with the question before it), instead of refusing."""
    first = await trusted.chat("What happened in incident 4711?", collection="trust")
    assert (await trusted.wait_job(first["job_id"]))["result"]["supported"] is True
    alone = (await ask(trusted, "And what caused it?"))["result"]
    assert alone["supported"] is False  # a new conversation: nothing to go on
    follow = await trusted.chat("And what caused it?", session_id=first["session_id"], collection="trust")
    result = (await trusted.wait_job(follow["job_id"]))["result"]
    assert result["supported"] is True, result
    assert [c["filename"] for c in result["citations"]][:1] == ["postmortem.txt"]
    # A question that changes the subject is not read with the one before it: refused, no model call.
    before = trusted.llm.count()
    switch = await trusted.chat("What is the capital of Australia?", session_id=first["session_id"],
                                collection="trust")
    assert (await trusted.wait_job(switch["job_id"]))["result"]["supported"] is False
    assert trusted.llm.count() == before


def test_a_golden_set_an_editor_saved_with_a_bom_is_read():
    from ragline import evaluation

    [q] = evaluation.parse_jsonl('\ufeff{"question": "q", "expected_document": null}\n')
    assert (q.question, q.expected_document) == ("q", None)


def test_a_golden_set_whose_line_breaks_curl_dropped_says_how_to_send_it():
    """`curl -d @golden.jsonl` (the usual way to send a file) strips its newlines: the API said only "line 1:
    Extra data: line 1 column 146", which told nobody what to change."""
    from ragline import evaluation

    joined = '{"question": "a", "expected_document": null}{"question": "b", "expected_document": null}'
    with pytest.raises(ValueError, match=r"line 1 holds more than one JSON object.*--data-binary @file"):
        evaluation.parse_jsonl(joined)
    with pytest.raises(ValueError, match=r"line 1 is a JSON array: send JSONL"):
        evaluation.parse_jsonl('[{"question": "a", "expected_document": null}]')
    with pytest.raises(ValueError, match=r"line 2: Expecting"):  # other broken JSON keeps the parser's words
        evaluation.parse_jsonl('{"question": "a", "expected_document": null}\n{"question": "b",\n')


async def test_an_evaluation_failing_on_an_unexpected_error_still_hands_on_the_answers_it_saved(tmp_path, monkeypatch):
    """Not one of Ragline's errors (a store client's, a bug): the step is retried as before, and its failure
    still carries the answers saved so far, for an operator's retry of the parked step."""
    from types import SimpleNamespace

    from temporalio.exceptions import ApplicationError
    from temporalio.testing import ActivityEnvironment

    import activities.evaluation as evaluation_activities
    import worker
    from models.evaluation import EvaluationInput
    from models.ingest import SearchHit
    from ragline.blobstore import BlobStore
    from ragline.settings import Settings
    from temporal import policies
    from tests.conftest import FIXTURES

    policies.load(FIXTURES.parent / "fast_policies.toml", worker.activity_names())  # heartbeats while it answers

    hit = SearchHit(text="The gateway's TLS certificate expired.", document_id="d", filename="postmortem.txt",
                    page=1, chunk=0, score=0.9, relevance=0.95)
    monkeypatch.setattr(evaluation_activities, "find_passages", lambda *args: [hit])

    class Model:
        calls = 0

        async def complete(self, messages, step):  # noqa: ANN001, ANN201
            Model.calls += 1
            if Model.calls == 2:
                raise RuntimeError("connection reset by the store")
            return SimpleNamespace(text="The TLS certificate [1].")

    blobs = BlobStore(tmp_path / "blobs")
    golden = "\n".join(json.dumps({"question": f"What expired? ({n})", "expected_document": "postmortem.txt"})
                       for n in range(3))
    activities = evaluation_activities.EvaluationActivities(Settings(data_dir=tmp_path), blobs, None, None, Model())
    req = EvaluationInput(collection="c", questions_ref=blobs.put(golden.encode()), questions=3, answers=True)
    with pytest.raises(ApplicationError) as failure:
        await ActivityEnvironment().run(activities.evaluate_collection, req)
    assert not failure.value.non_retryable and failure.value.type == "RuntimeError"
    [saved] = failure.value.details[0]["checkpoints"]
    assert [o["question"] for o in blobs.get_json(saved)] == ["What expired? (0)"]
