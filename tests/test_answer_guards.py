"""Guards on what the model streams: a reply that loops ("[1] [2] [1] [2] …", seen from the default
0.5B Qwen on a Chinese question until max tokens) is stopped, cut and flagged; normal prose, lists,
tables and code pass untouched. The detector is tested as a pure function, the whole path once on the
real stack with the scripted model."""

from __future__ import annotations

import pytest

from activities.chat import REPETITION_WARNING
from ragline.llm import (
    LAYOUT_MIN_CHARS, LAYOUT_MIN_REPEATS, LONG_LOOP_MAX_UNIT, LONG_LOOP_MIN_REPEATS, LOOP_CHECK_EVERY, LOOP_MAX_UNIT,
    LOOP_MIN_CHARS, LOOP_MIN_REPEATS, LoopGuard, cut_repetition,
)
from tests.helpers import eventually, read_events

LOOP = "[1] [2] "


def streamed_prefixes(text: str, piece: int = 3) -> list[str]:
    """The texts the stream has seen after each piece of `piece` characters (the guard runs on each)."""
    return [text[:end] for end in range(piece, len(text) + piece, piece)]


# -- the detector ----------------------------------------------------------------------------------

def test_the_loop_seen_from_the_small_model_is_cut_to_one_occurrence():
    assert cut_repetition(LOOP * 64) == LOOP
    answer = "单次大模型调用的超时阈值为45秒[1]。"
    assert cut_repetition(answer + LOOP * 64) == answer + LOOP


def test_a_loop_cut_off_mid_unit_is_still_one():
    """The stream stops wherever a piece ends, seldom at the end of a unit."""
    answer = "The timeout is 45 seconds [1]."
    assert cut_repetition(answer + " " + LOOP * 40 + "[1") == answer + " [1] [2]"


def guard_trips_at(text: str, piece: int = 3) -> int | None:
    """How much of `text` the stream had shown when the guard, fed piece by piece, saw a loop."""
    guard = LoopGuard()
    for end in range(piece, len(text) + piece, piece):
        if guard.looping(text[end - piece:end]):
            return min(end, len(text))
    return None


def test_the_loop_is_found_as_soon_as_the_stream_shows_it():
    """Streamed piece by piece, the guard trips within a check of the thresholds, not at max tokens."""
    text = "The timeout is 45 seconds [1]. " + LOOP * 200
    seen = guard_trips_at(text)
    assert seen is not None
    assert seen <= len("The timeout is 45 seconds [1]. ") + LOOP_MIN_CHARS + len(LOOP) + LOOP_CHECK_EVERY
    assert cut_repetition(text[:seen]).rstrip() == ("The timeout is 45 seconds [1]. " + LOOP).rstrip()


SENTENCE = "Model calls time out after 45 seconds, I said [1]. "  # 51 characters
PARAGRAPH = " ".join(f"step{n}" for n in range(80)) + ".\n"  # no part of it repeats


@pytest.mark.parametrize("unit, repeats, loops", [
    ("好", LOOP_MIN_CHARS, True),
    ("好", LOOP_MIN_CHARS - 1, False),                      # too short a run
    (SENTENCE[:LOOP_MAX_UNIT], LOOP_MIN_REPEATS, True),
    (SENTENCE[:LOOP_MAX_UNIT], LOOP_MIN_REPEATS - 1, False),  # too few repeats
    (SENTENCE[:LOOP_MAX_UNIT + 1], LONG_LOOP_MIN_REPEATS - 1, False),  # a longer unit: from fewer repeats
    (SENTENCE[:LOOP_MAX_UNIT + 1], LONG_LOOP_MIN_REPEATS, True),
    (PARAGRAPH[:LONG_LOOP_MAX_UNIT], LONG_LOOP_MIN_REPEATS, True),
    (PARAGRAPH[:LONG_LOOP_MAX_UNIT + 1], LONG_LOOP_MIN_REPEATS, False),  # a unit too long to count
])
def test_the_thresholds(unit, repeats, loops):
    assert (cut_repetition("Answer: " + unit * repeats) is not None) is loops


# What the default model was seen to do on an English question: one sentence, again and again.
SENTENCE_LOOP = ("The lighthouse of harbour 3 is painted red, and its keeper lights it at dusk [1]. " * 12)


def test_a_sentence_that_loops_is_cut_after_a_few_repeats():
    answer = "Harbour 3 has a lighthouse [1]. "
    seen = guard_trips_at(answer + SENTENCE_LOOP)
    unit = len(SENTENCE_LOOP) // 12
    assert seen is not None and seen <= len(answer) + LONG_LOOP_MIN_REPEATS * unit + LOOP_CHECK_EVERY
    cut = cut_repetition((answer + SENTENCE_LOOP)[:seen])
    # The loop's first occurrence stays (where the loop starts is ambiguous by the units' common ending).
    assert (answer + SENTENCE_LOOP).startswith(cut) and cut.count("painted red") == 1
    assert len(answer) + unit - len(" [1]. ") <= len(cut) <= len(answer) + unit


def test_a_paragraph_said_again_is_not_a_loop():
    """A model may restate its point once or twice, in the same words: that is style, not a loop."""
    paragraph = ("The lighthouse of harbour 3 is painted red [1]. Its keeper lights it at dusk and puts it out "
                 "at dawn [2].\n\n")
    text = "In short:\n\n" + paragraph * (LONG_LOOP_MIN_REPEATS - 1) + "That is all the documents say."
    assert [seen for seen in streamed_prefixes(text) if cut_repetition(seen) is not None] == []


ROW = "| - | - | - |\n"
ROWS_THAT_LOOP = max(LAYOUT_MIN_REPEATS, -(-LAYOUT_MIN_CHARS // len(ROW)))  # both thresholds reached


@pytest.mark.parametrize("unit, repeats, loops", [
    ("=", LAYOUT_MIN_CHARS, True),                        # a rule this long is a loop
    ("=", LAYOUT_MIN_CHARS - 1, False),
    (ROW, ROWS_THAT_LOOP, True),                          # a blank table's rows: only this many
    (ROW, ROWS_THAT_LOOP - 1, False),
])
def test_layout_counts_only_from_its_own_thresholds(unit, repeats, loops):
    assert (cut_repetition("Answer:\n" + unit * repeats) is not None) is loops


ENGLISH_PROSE = (
    "The root cause of incident 4711 was an expired TLS certificate on the internal payment gateway proxy [1]. "
    "The renewal job had failed for three weeks because its service account lost write permission to the "
    "secrets vault [1]. About 12,400 orders failed during the outage [1]. No, no, no: the database was fine.")
CHINESE_PROSE = (
    "单次大模型调用的超时阈值为45秒，超过45秒的调用会被中断并按重试策略重试[1]。每个请求最多重试3次，"
    "重试间隔从2秒开始，每次翻倍[1]。数据库每天凌晨两点进行全量备份，备份文件保留35天[2]。"
    "如果备份失败，值班工程师会在十五分钟内收到告警，并需要在当天重新执行备份任务[2]。"
    "好的，好的，好的，就是这样：请按手册操作，按手册操作，按手册操作。")
NUMBERED_LIST = "Steps to renew the certificate:\n" + "".join(
    f"{n}. Step {n}: check the renewal job [1].\n" for n in range(1, 13))
CHINESE_LIST = "备份步骤：\n" + "".join(f"{n}. 第{n}步：检查备份文件 [2]。\n" for n in range(1, 13))
TABLE = (
    "| 章节 | 内容 | 超时 | 重试 | 备注 |\n"
    "| --- | --- | --- | --- | --- |\n"
    + "".join(f"| 第{n}章 | 大模型服务 | 45秒 | 3次 | - |\n" for n in range(1, 9))
    + "| 第九章 | 数据备份 | - | - | - |\n")
CODE = (
    "```python\n"
    "# " + "-" * 76 + "\n"
    "def call_with_retries(call, attempts: int = 3, first_wait: float = 2.0):\n"
    "    for attempt in range(attempts):\n"
    "        try:\n"
    "            return call(timeout=45)\n"
    "        except TimeoutError:\n"
    "            time.sleep(first_wait * 2 ** attempt)\n"
    "    raise TimeoutError('gave up')\n\n\n"
    "WEIGHTS = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]\n"
    "MATRIX = [[0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]\n"
    "```\n")
WIDE_BLANK_FORM = ("| Date | Room | Signature |\n" + f"|{' ' * 20}|{' ' * 20}|{' ' * 20}|\n" * 12)
BLANK_FORM = ("Fill in one row per visit:\n| Date | Room | Signature |\n| --- | --- | --- |\n"
              + "| - | - | - |\n" * 12 + "Sign each row.")
RULES = "第一部分\n" + "——" * 80 + "\n" + "=" * 160 + "\nContents" + "." * 120 + "3\n"


@pytest.mark.parametrize("text", [BLANK_FORM, WIDE_BLANK_FORM, RULES],
                         ids=["blank-table-rows", "wide-blank-rows", "rules-and-leaders"])
def test_layout_that_repeats_is_not_a_loop(text):
    assert [seen for seen in streamed_prefixes(text) if cut_repetition(seen) is not None] == []
    assert guard_trips_at(text) is None


@pytest.mark.parametrize("text", [ENGLISH_PROSE, CHINESE_PROSE, NUMBERED_LIST, CHINESE_LIST, TABLE, CODE],
                         ids=["english", "chinese", "numbered-list", "chinese-list", "table", "code"])
def test_normal_answers_never_trip_the_guard(text):
    assert len(text) > LOOP_MIN_CHARS
    assert [seen for seen in streamed_prefixes(text) if cut_repetition(seen) is not None] == []
    assert guard_trips_at(text) is None


# -- the whole path ----------------------------------------------------------------------------------

TIMEOUTS = ("Model calls time out after 45 seconds. A call that times out is retried up to 3 times, "
            "waiting 2 seconds before the first retry and twice as long before each next one.")


@pytest.fixture(scope="module")
async def timeouts_doc(stack):
    body = await stack.upload(("timeouts.txt", TIMEOUTS.encode()), collection="guards")
    assert (await stack.wait_job(body["job_id"]))["status"] == "completed"


async def test_a_looping_answer_is_stopped_cut_and_flagged(stack, timeouts_doc):
    answer = "The timeout is 45 seconds [1]."
    looping = f"{answer} {LOOP * 200}"
    # A pause between chunks keeps the model generating while the worker reads, as a real one does.
    with stack.llm.scope(stream_chunk_delay=0.01) as llm:
        llm.script("answer", [looping])
        accepted = await stack.chat(f"How long before a model call times out? {llm.token}", collection="guards")
        job = await stack.wait_job(accepted["job_id"])
        [call] = llm.calls("answer")
    assert job["status"] == "completed", job
    result = job["result"]
    assert result["answer"] == f"{answer} [1] [2]"
    assert REPETITION_WARNING in result["warnings"]
    assert [c["filename"] for c in result["citations"]] == ["timeouts.txt"]

    async def closed_early() -> bool:
        return call.finished_at is not None and call.cut_off
    # The worker closed the model's stream: the server saw it go away before the reply was complete.
    await eventually(closed_early, what="the scripted model seeing its stream closed before the end")

    events = await read_events(stack, accepted["job_id"])
    shown = "".join(e["data"]["text"] for _, e in events if e["type"] == "ragline.answer.delta")
    [completed] = [e["data"] for _, e in events if e["type"] == "ragline.answer.completed"]
    # What was streamed cannot be taken back: it shows part of the loop. The answer is the cut text.
    assert shown.startswith(result["answer"]) and len(shown) < len(looping) // 4
    assert completed["answer"] == result["answer"]
    # The cut reply sent no usage: its tokens are estimated, not counted as none.
    assert result["usage"]["prompt_tokens"] > 0 and result["usage"]["completion_tokens"] > 0


# -- what fits in the model's context --------------------------------------------------------------

def test_a_question_longer_than_the_context_can_answer_is_refused_before_any_model_call():
    """7,980 Chinese characters passed the API's 8,000-character limit, and every attempt of the answer
    overflowed llama.cpp's 4,096-token context until the turn parked and held its session."""
    from temporalio.exceptions import ApplicationError
    from temporalio.testing import ActivityEnvironment

    from activities.chat import ChatActivities
    from models.chat import RetrieveInput
    from ragline.llm import question_budget, too_long_a_question
    from ragline.settings import Settings

    settings = Settings(llm_context_tokens=4096, llm_max_tokens=512)
    assert too_long_a_question("一线城市每晚住宿标准是多少？" * 100, settings) is None  # 1,400 tokens
    reason = too_long_a_question("一线城市每晚住宿标准是多少？" * 570, settings)
    assert reason is not None and f"leaves {question_budget(settings)} for a question" in reason
    assert too_long_a_question("What is the limit? " * 300, settings) is None  # 5,700 characters, ~1,425 tokens
    # A context configured smaller than the answer's tokens still takes a short question.
    assert too_long_a_question("hi, what is the limit?", Settings(llm_context_tokens=712, llm_max_tokens=512)) is None
    # A turn accepted before the API refused such questions (or by an API with other settings) fails at its
    # first step, not retried, with the reason.
    activities = ChatActivities(settings, None, None, None, None)  # nothing of them is reached
    with pytest.raises(ApplicationError) as failure:
        ActivityEnvironment().run(activities.retrieve_context, RetrieveInput(
            question="一线城市每晚住宿标准是多少？" * 570, collection="zh", top_k=5))
    assert failure.value.non_retryable and failure.value.type == "InputError"
    assert "shorten it" in failure.value.message


def test_the_answer_is_given_the_most_recent_turns_that_fit():
    from activities.chat import recent_turns
    from models.chat import HistoryItem
    from ragline.llm import estimate_tokens

    long_zh = [HistoryItem(question=f"第{i}个问题" + "很" * 590, answer="答" * 600) for i in range(4)]
    kept = recent_turns(long_zh, room=2500)  # each turn about 1,200 tokens
    assert [k.split("\n")[0][:6] for k in kept] == ["Q: 第2个", "Q: 第3个"]
    short = [HistoryItem(question="Who counts the herds?", answer="The shepherd [1].")] * 4
    assert len(recent_turns(short, room=2500)) == 4
    # The latest turn alone too long for what is left: it is there all the same, its end cut.
    [latest] = recent_turns(long_zh, room=370)
    assert latest.startswith("Q: 第3个问题") and latest.endswith("…") and estimate_tokens(latest) <= 370
    assert recent_turns(long_zh, room=0) == []
