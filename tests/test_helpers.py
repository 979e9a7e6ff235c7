"""The pure helpers the workflows and activities rely on, without any server: reading the model's entity
JSON, mapping an answer to the passages it cites, estimating tokens, reading Temporal failures, job ids,
goal comparison and the agent's tool-call checks."""

from __future__ import annotations

import pytest
from temporalio.exceptions import (
    ActivityError, ApplicationError, ChildWorkflowError, RetryState, TimeoutError, TimeoutType,
)

from activities.agent import checked_call
from activities.chat import (
    NO_ANSWER_SHOWN_CHARS, EchoedTurn, citation, cited_passages, distinct, estimate_tokens, marked_passages,
    no_answer_warning, parse_entities, quote_for,
)
from models.chat import Entity, session_of_turn, turn_job_id
from models.ingest import SearchHit
from ragline import prompts
from workflows.agent import normalise_goal
from workflows.failures import exhausted_retries, failure_reason, failure_type


# -- activities.chat.parse_entities --------------------------------------------------------------------

def entities(*pairs: tuple[str, str]) -> list[Entity]:
    return [Entity(text=t, type=k) for t, k in pairs]


@pytest.mark.parametrize("reply, expected", [
    ('[{"text": "Ada Lovelace", "type": "PERSON"}]', entities(("Ada Lovelace", "PERSON"))),
    # Code fences, with or without a language.
    ('```json\n[{"text": "Ada", "type": "PERSON"}]\n```', entities(("Ada", "PERSON"))),
    ('```\n[{"text": "Ada", "type": "PERSON"}]\n```', entities(("Ada", "PERSON"))),
    # Prose around the array.
    ('Sure! Here they are: [{"text": "Paris", "type": "PLACE"}] Hope that helps.', entities(("Paris", "PLACE"))),
    # Trailing commas, in the array and in an object.
    ('[{"text": "Paris", "type": "PLACE",}, {"text": "1999", "type": "DATE"},]',
     entities(("Paris", "PLACE"), ("1999", "DATE"))),
    # Single quotes (and everything at once).
    ("```json\n[{'text': 'Serengeti', 'type': 'place'},]\n```", entities(("Serengeti", "PLACE"))),
    # An empty array is a valid answer: no entities.
    ("[]", []),
    # A bracket in the prose after the array, and an apostrophe inside a value.
    ('[{"text": "Ada", "type": "PERSON"}] (see [1])', entities(("Ada", "PERSON"))),
    ("""[{'text': "O'Brien", 'type': 'person'}]""", entities(("O'Brien", "PERSON"))),
])
def test_parse_entities_repairs_the_usual_damage(reply, expected):
    assert parse_entities(reply) == expected


def test_parse_entities_dedupes_maps_types_and_skips_unusable_items():
    reply = """[{"text": " Ada ", "type": "person"}, {"text": "ada", "type": "ORG"},
                {"text": "Thing", "type": "GADGET"}, {"text": "Nameless"}, {"text": "Odd", "type": null},
                {"text": "   ", "type": "ORG"}, {"type": "ORG"}, "Bare string", 42, {"text": 7, "type": "DATE"}]"""
    assert parse_entities(reply) == entities(("Ada", "PERSON"), ("Thing", "OTHER"), ("Nameless", "OTHER"),
                                             ("Odd", "OTHER"))


@pytest.mark.parametrize("reply", ["[1]", "[1, 2]", '["Maria Costa", "Lisbon"]'])
def test_a_list_without_any_entity_object_is_nothing_usable_not_no_entities(reply):
    """The 0.5B model answers the entities prompt with "[1]" now and then: that is no answer (the step asks
    again, once), not a text without entities."""
    assert parse_entities(reply) is None


def test_parse_entities_keeps_at_most_ten_in_order():
    reply = "[" + ", ".join(f'{{"text": "E{i}", "type": "ORG"}}' for i in range(15)) + "]"
    assert [e.text for e in parse_entities(reply)] == [f"E{i}" for i in range(10)]


@pytest.mark.parametrize("reply", [
    "", "no entities here", "Sure! Here are the entities: none of them", "{still not json", "[not json",
    '{"text": "Ada", "type": "PERSON"}',  # an object, not an array
    "] backwards [",
])
def test_parse_entities_gives_up_on_garbage(reply):
    assert parse_entities(reply) is None


# -- activities.chat.cited_passages --------------------------------------------------------------------

def passage(text: str, doc: str = "d", page: int = 1) -> SearchHit:
    return SearchHit(text=text, document_id=doc, filename=f"{doc}.txt", page=page, chunk=0, score=0.5)


PASSAGES = [
    passage("The great zebra migration crosses the Mara river every July.", "zebra"),
    passage("Paper cranes are folded from a single square sheet of paper.", "paper", 3),
    passage("Rangers of the Serengeti count the herds from small aircraft.", "rangers", 2),
]


@pytest.mark.parametrize("answer, cited", [
    ("Rangers count from the air [3], in July [1].", [1, 3]),          # numbered, sorted, each once
    ("Folded paper, see [2][2] and again [2].", [2]),
    ("[1] says the river, and [4] and [0] and [12] do not exist.", [1]),  # out of range: ignored
    # No valid marker: the answer is attributed by its words instead.
    ("Zebras cross the Mara river every July [9].", [1]),
])
def test_cited_passages_reads_the_markers(answer, cited):
    assert cited_passages(answer, PASSAGES) == cited


@pytest.mark.parametrize("answer, cited", [
    # A marker on words its passage does not have (a small model copying a prompt's example): no citation,
    # so the answer is not "supported".
    ("45 seconds [2]", []),
    # The wrong number: the passage the words come from is the one cited.
    ("Cranes are folded from square sheets of paper [1].", [2]),
    # Across languages words cannot be compared: the marker stands.
    ("斑马每年七月渡过马拉河[1]。", [1]),
])
def test_a_marker_counts_only_where_its_passage_bears_the_answer_out(answer, cited):
    assert cited_passages(answer, PASSAGES) == cited


def test_an_uncited_answer_is_attributed_by_shared_words():
    assert cited_passages("Zebras cross the Mara river every July.", PASSAGES) == [1]
    assert cited_passages("Cranes are folded from square sheets of paper.", PASSAGES) == [2]
    assert cited_passages("The Serengeti rangers count herds; the zebra migration crosses the Mara river.",
                          PASSAGES) == [1, 3]


def test_an_uncited_chinese_answer_is_attributed_by_shared_words():
    chinese = [passage("斑马每年七月渡过马拉河。", "zebra"), passage("纸鹤是用一张正方形的纸折成的。", "paper")]
    assert cited_passages("斑马七月渡过马拉河", chinese) == [1]
    assert cited_passages("纸鹤用正方形的纸折成", chinese) == [2]


def test_short_chinese_phrases_are_attributed():
    # Runs of two or three CJK characters are compared as they are.
    chinese = [passage("斑马 七月 渡河", "zebra"), passage("纸鹤 折纸", "paper")]
    assert cited_passages("斑马 七月", chinese) == [1]


@pytest.mark.parametrize("answer, passages", [
    ("I don't know: the documents do not contain it.", PASSAGES),   # nothing shared
    ("", PASSAGES),
    ("?! ...", PASSAGES),                                             # no words at all
    ("The zebra migration [1].", []),                                 # no passages
    ("Zebras cross the Mara river every July.", []),
])
def test_cited_passages_finds_nothing(answer, passages):
    assert cited_passages(answer, passages) == []


@pytest.mark.parametrize("answer, count, marked", [
    ("Lit at dusk [2], high tide at noon [1] [2].", 2, [1, 2]),
    ("Only [3] and [0] and [12], none of them there.", 2, []),
    ("No marker at all.", 2, []),
])
def test_marked_passages_are_the_numbers_of_passages_that_exist(answer, count, marked):
    assert marked_passages(answer, count) == marked


# -- activities.chat.no_answer_warning -------------------------------------------------------------------

@pytest.mark.parametrize("reply, told", [
    ("[1] [2]", 'citation markers only ("[1] [2]")'),  # what the 0.5B local model replied
    ("[1][3]", 'citation markers only ("[1][3]")'),
    ("[1", 'citation markers only ("[1")'),            # a marker cut off
    ("", "reply had no words"),
    ("?! ...", "reply had no words"),
])
def test_a_reply_without_words_is_told_for_what_it_was(reply, told):
    warning = no_answer_warning(reply)
    assert warning is not None and told in warning and "no answer" in warning
    assert "unverified" not in warning  # nothing was answered that could be checked


def test_a_long_run_of_markers_is_quoted_shortened():
    reply = "[1] [2] [3] " * 20
    warning = no_answer_warning(reply)
    assert f'("{reply[:NO_ANSWER_SHOWN_CHARS]}…")' in warning


@pytest.mark.parametrize("reply", ["45", "An expired TLS certificate [1].", "斑马[1]", "[1] 45"])
def test_a_reply_with_words_of_its_own_is_an_answer(reply):
    assert no_answer_warning(reply) is None
    assert no_answer_warning(reply, "What expired?") is None


@pytest.mark.parametrize("reply, question", [
    ("[1] (zh.md, page 1) 那由谁审批？", "那由谁审批？"),  # the 0.5B model, on a follow-up (the walkthrough)
    ("What expired? [1]", "What expired?"),
    ("what EXPIRED", "What expired?"),
])
def test_a_reply_that_only_repeats_the_question_is_no_answer(reply, question):
    warning = no_answer_warning(reply, question)
    assert warning is not None and "repeated the question" in warning and "no answer" in warning
    assert no_answer_warning(reply + " The certificate did [2].", question) is None  # it went on to answer


# -- activities.chat.estimate_tokens -------------------------------------------------------------------

@pytest.mark.parametrize("text, tokens", [
    ("", 0), ("a", 1), ("abcd", 1), ("abcde", 2), ("x" * 400, 100),
    ("斑马", 2), ("a斑马b", 3),   # a CJK character is about one token
    ("斑马渡河。", 5),               # the full stop is other text: rounded up to a token
])
def test_estimate_tokens(text, tokens):
    assert estimate_tokens(text) == tokens


def test_estimate_tokens_over_estimates_english_words():
    text = "The great zebra migration crosses the Mara river every July. " * 20
    assert estimate_tokens(text) >= len(text.split())


# -- workflows.failures --------------------------------------------------------------------------------

def activity_error(cause: BaseException, retry_state: RetryState | None) -> ActivityError:
    exc = ActivityError("activity failed", scheduled_event_id=5, started_event_id=6, identity="worker",
                        activity_type="generate_answer", activity_id="7", retry_state=retry_state)
    exc.__cause__ = cause
    return exc


def child_error(cause: BaseException) -> ChildWorkflowError:
    exc = ChildWorkflowError("child failed", namespace="default", workflow_id="doc-1", run_id="r",
                             workflow_type="IngestDocumentWorkflow", initiated_event_id=1, started_event_id=2,
                             retry_state=RetryState.NON_RETRYABLE_FAILURE)
    exc.__cause__ = cause
    return exc


def test_failure_reason_is_the_innermost_message():
    bad_pdf = ApplicationError("encrypted: password required", type="InputError", non_retryable=True)
    assert failure_reason(activity_error(bad_pdf, RetryState.NON_RETRYABLE_FAILURE)) == \
        "encrypted: password required"
    # Through a child workflow and its activity.
    nested = child_error(activity_error(bad_pdf, RetryState.NON_RETRYABLE_FAILURE))
    assert failure_reason(nested) == "encrypted: password required"
    assert failure_type(nested) == "InputError"
    assert failure_reason(bad_pdf) == "encrypted: password required"


@pytest.mark.parametrize("kind, reason", [
    (TimeoutType.START_TO_CLOSE, "timed out (start-to-close)"),
    (TimeoutType.HEARTBEAT, "timed out (heartbeat)"),
    (TimeoutType.SCHEDULE_TO_CLOSE, "timed out (schedule-to-close)"),
    (None, "timed out (timeout)"),
])
def test_failure_reason_of_a_timeout_names_the_timeout(kind, reason):
    timeout = TimeoutError("activity timeout", type=kind, last_heartbeat_details=[])
    exc = activity_error(timeout, RetryState.MAXIMUM_ATTEMPTS_REACHED)
    assert failure_reason(exc) == reason
    assert failure_type(exc) == "TimeoutError"


def test_failure_reason_and_type_of_other_errors():
    assert failure_reason(activity_error(RuntimeError("disk full"), RetryState.TIMEOUT)) == "disk full"
    assert failure_reason(activity_error(RuntimeError(), RetryState.TIMEOUT)) == "RuntimeError"
    assert failure_type(activity_error(RuntimeError("x"), RetryState.TIMEOUT)) == "RuntimeError"
    # An ActivityError without a cause is its own reason.
    assert failure_reason(ActivityError("gone", scheduled_event_id=1, started_event_id=2, identity="w",
                                        activity_type="a", activity_id="1", retry_state=None)) == "gone"
    assert failure_type(ApplicationError("untyped")) is None
    assert failure_type(ApplicationError("typed", type="ProviderRejectedError")) == "ProviderRejectedError"


@pytest.mark.parametrize("cause, state, exhausted", [
    # A retryable failure that used up the policy: park it for an operator.
    (ApplicationError("503", type="ProviderUnavailableError"), RetryState.MAXIMUM_ATTEMPTS_REACHED, True),
    (TimeoutError("t", type=TimeoutType.START_TO_CLOSE, last_heartbeat_details=[]),
     RetryState.MAXIMUM_ATTEMPTS_REACHED, True),
    (ApplicationError("slow", type="TransientError"), RetryState.TIMEOUT, True),
    # Non-retryable, raised as such or by the policy's non_retryable types: fail, never park.
    (ApplicationError("bad input", type="InputError", non_retryable=True), RetryState.NON_RETRYABLE_FAILURE, False),
    (ApplicationError("bad input", type="InputError", non_retryable=True), RetryState.MAXIMUM_ATTEMPTS_REACHED,
     False),
    (ApplicationError("rejected", type="ProviderRejectedError"), RetryState.NON_RETRYABLE_FAILURE, False),
    # Anything else did not exhaust a retry policy.
    (ApplicationError("cancelled"), RetryState.CANCEL_REQUESTED, False),
    (ApplicationError("x"), RetryState.RETRY_POLICY_NOT_SET, False),
    (ApplicationError("x"), None, False),
])
def test_exhausted_retries(cause, state, exhausted):
    assert exhausted_retries(activity_error(cause, state)) is exhausted


# -- models.chat: turn job ids ---------------------------------------------------------------------------

def test_turn_job_ids_are_stable_per_session_and_key_and_name_their_session():
    job = turn_job_id("s-1_A", "key-1")
    assert job == turn_job_id("s-1_A", "key-1")
    assert job.startswith("chat-s-1_A.") and len(job.rsplit(".", 1)[1]) == 20
    assert job != turn_job_id("s-1_A", "key-2") and job != turn_job_id("s-1_B", "key-1")
    # The key's text cannot be shifted between session and key to collide.
    assert turn_job_id("a", "b\nc") != turn_job_id("a\nb", "c")
    assert session_of_turn(job) == "s-1_A"
    assert session_of_turn(turn_job_id("x" * 64, "k")) == "x" * 64


@pytest.mark.parametrize("job_id", [
    "doc-abc", "agent-123", "session-s1", "chat-s1", "chat-s1.ABCDEF0123456789abcd", "chat-s1.0123",
    "chat-s.1.0123456789abcdef0123", "chat-.0123456789abcdef0123", "xchat-s1.0123456789abcdef0123",
    "chat-s1.0123456789abcdef0123.1", "chat-" + "x" * 65 + ".0123456789abcdef0123",
])
def test_session_of_turn_refuses_other_ids(job_id):
    assert session_of_turn(job_id) is None


# -- workflows.agent.normalise_goal ----------------------------------------------------------------------

def test_normalise_goal_ignores_case_spacing_and_end_punctuation():
    assert normalise_goal("  Find the   Lighthouse keeper?! ") == "find the lighthouse keeper"
    assert normalise_goal("FIND THE LIGHTHOUSE KEEPER!") == normalise_goal("find the lighthouse keeper.")
    assert normalise_goal("Find\tthe\nkeeper") == "find the keeper"
    assert normalise_goal("find the keeper") != normalise_goal("find the keepers")
    assert normalise_goal("...") == ""


# -- activities.agent.checked_call -----------------------------------------------------------------------

ALLOWED = {t["function"]["name"]: t["function"]["parameters"] for t in prompts.agent_tools()}


def test_checked_call_accepts_allowlisted_tools_and_trims_arguments():
    call = checked_call("search_documents", '{"query": "  high tide at Vell "}', ALLOWED)
    assert call.error is None and call.name == "search_documents" and call.arguments == {"query": "high tide at Vell"}
    assert checked_call("delegate", '{"subgoal": "a part"}', ALLOWED).arguments == {"subgoal": "a part"}
    assert checked_call("finish", '{"answer": "done"}', ALLOWED).arguments == {"answer": "done"}


@pytest.mark.parametrize("name, arguments, error", [
    ("rm_rf", '{"path": "/"}', "unknown tool 'rm_rf'; allowed: delegate, finish, search_documents"),
    ("search_documents", "{bad", "arguments of search_documents are not valid JSON"),
    ("search_documents", "[1]", "arguments of search_documents must be an object"),
    ("finish", "null", "arguments of finish must be an object"),
    ("search_documents", '{"q": "x"}', "search_documents needs a non-empty string 'query'"),
    ("search_documents", '{"query": "   "}', "search_documents needs a non-empty string 'query'"),
    ("delegate", '{"subgoal": 3}', "delegate needs a non-empty string 'subgoal'"),
    ("finish", "", "finish needs a non-empty string 'answer'"),
    ("search_documents", '{"query": "tides", "top_k": 3}', "search_documents got unknown argument(s): top_k"),
])
def test_checked_call_turns_bad_calls_into_tool_errors(name, arguments, error):
    call = checked_call(name, arguments, ALLOWED)
    assert call.error == error and call.arguments == {} and call.name == name


def test_an_answer_citing_two_overlapping_chunks_shows_their_shared_sentence_once():
    """Adjacent chunks share RAGLINE_CHUNK_OVERLAP characters: an answer citing [1] and [2] for a sentence in
    that overlap showed it twice (found by the walkthrough). Another sentence, or another document, stays."""
    shared = "Synchronous calls block a worker for the whole model call."
    answer = "Synchronous calls block a worker for the whole model call [1][2]."
    hits = [SearchHit(text=f"Intro. {shared}", document_id="d1", filename="a.txt", page=1, chunk=0, score=0.9),
            SearchHit(text=f"{shared} Then more.", document_id="d1", filename="a.txt", page=1, chunk=1, score=0.8),
            SearchHit(text=f"Elsewhere: {shared}", document_id="d2", filename="b.txt", page=1, chunk=0, score=0.7)]
    kept = distinct([citation(h, quote_for(answer, h.text)) for h in hits])
    assert [(c.document_id, c.chunk_id) for c in kept] == [("d1", "d1:0"), ("d2", "d2:0")]
    # The overlap of chunks 15 and 16 crossed a page break: they begin on pages 5 and 6, one sentence still.
    star = "I do not often go star-gazing, but last night I sat and watched."
    across = [SearchHit(text=f"{star} Page six.", document_id="v", filename="v.pdf", page=6, chunk=16, score=0.9),
              SearchHit(text=f"Page five. {star}", document_id="v", filename="v.pdf", page=5, chunk=15, score=0.8),
              SearchHit(text=f"Much later. {star}", document_id="v", filename="v.pdf", page=9, chunk=30, score=0.7)]
    kept = distinct([citation(h, quote_for(star, h.text)) for h in across])
    assert [c.chunk_id for c in kept] == ["v:16", "v:30"]
    # A text file is one page: the same sentence in chunks far apart on it is still one citation.
    one_page = [h.model_copy(update={"page": 1}) for h in across]
    assert [c.chunk_id for c in distinct([citation(h, quote_for(star, h.text)) for h in one_page])] == ["v:16"]


def test_a_quote_keeps_the_numbers_of_its_sentence_whole():
    """A quote is the passage's sentence the answer draws on: the dot of "2.5" ended a sentence, and the
    walkthrough's answer "2.5 million dollars" was quoted "5 million dollars for the year.", misstating it."""
    passage = "Intro here. The total budget of Project Falcon was 2.5 million dollars for the year. Other things."
    assert quote_for("[1] 2.5 million dollars", passage) == \
        "The total budget of Project Falcon was 2.5 million dollars for the year."
    assert quote_for("预算为2.5百万元", "公司简介。项目总预算为2.5百万元。其他内容。") == "项目总预算为2.5百万元。"
    assert quote_for("Michelle Poirier, version 1.0", "Toponymy. Author: Michelle Poirier Version: 1.0 Date: 2005.") \
        == "Author: Michelle Poirier Version: 1.0 Date: 2005."
    # Sentences still end at a dot before a space, at 。！？ and at a newline, with what closes them.
    assert quote_for("the second", "The first one. The second one!\nThe third") == "The second one!"
    passage = 'Staff must file "Form 12." Claims are paid within 30 days.Late claims lapse.'
    assert quote_for("Claims are paid within 30 days", passage) == "Claims are paid within 30 days."
    assert quote_for("see the annex", "Read it (see the annex B.) Then go.") == "Read it (see the annex B.)"


@pytest.mark.parametrize(("reply", "answer"), [
    ("Q: 那么每天的餐补是多少？\nA: 120 元，不需要发票 [1]。", "120 元，不需要发票 [1]。"),
    ("  Q: And how often?\nA:   Every July [1].", "Every July [1]."),
    ("Every July [1].", "Every July [1]."),
    ("Quite often [1].", "Quite often [1]."),  # opens with a Q, not with "Q:"
    ("Q: a question the reply never answers", "Q: a question the reply never answers"),
    ("Q: " + "x" * 300 + "\nA: y", "Q: " + "x" * 300 + "\nA: y"),  # no echo of a 20-character question
    ("Q: 那么每天的餐补是多少？需要发票吗？" + "x" * 194 + "\nA: y", "y"),  # the mark ends at the bound
    ("", ""),
])
def test_an_answer_opening_with_its_question_in_the_historys_form_is_shown_without_it(reply, answer):
    question = "那么每天的餐补是多少？需要发票吗？"
    assert EchoedTurn.strip(question, reply) == answer
    for size in (1, 3, 7):  # streamed: what the pieces show is the answer
        echo = EchoedTurn(question)
        assert "".join(echo.feed(reply[i:i + size]) for i in range(0, len(reply), size)) + echo.end() == answer


def test_an_answer_not_opening_with_q_streams_its_first_piece_at_once():
    """The echo filter holds back only what may open an echo: a first piece of one character ("项", a token of
    a local model) is not kept for the next, which would delay the first delta by a token."""
    echo = EchoedTurn("项目总预算是多少？")
    assert echo.feed(" ") == "" and echo.feed("项") == " 项" and echo.feed("目") == "目"
    held = EchoedTurn("How often?")
    assert held.feed("Q") == "" and held.feed("uite often.") == "Quite often."


# -- ragline.embeddings.InferenceTurns ---------------------------------------------------------------

def test_a_query_goes_before_the_document_batches_waiting_for_the_embedder():
    """A search's query waits for the batch under way only, not for an upload's batches queued behind it."""
    import threading
    import time

    from ragline.embeddings import InferenceTurns

    turns, order, running = InferenceTurns(), [], threading.Event()
    release = threading.Event()

    def batch(name: str, hold: bool = False) -> None:
        with turns.take(query=False):
            order.append(name)
            if hold:
                running.set()
                release.wait(10)

    def query() -> None:
        with turns.take(query=True):
            order.append("query")

    first = threading.Thread(target=batch, args=("batch 0", True))
    first.start()
    assert running.wait(10)
    waiting = [threading.Thread(target=batch, args=(f"batch {i}",)) for i in range(1, 4)]
    for t in waiting:
        t.start()
    asker = threading.Thread(target=query)
    asker.start()
    deadline = time.monotonic() + 10
    while turns._queries_waiting == 0 and time.monotonic() < deadline:  # the query is in line
        time.sleep(0.01)
    release.set()
    for t in [first, *waiting, asker]:
        t.join(10)
    assert order[:2] == ["batch 0", "query"] and sorted(order[2:]) == ["batch 1", "batch 2", "batch 3"], order
