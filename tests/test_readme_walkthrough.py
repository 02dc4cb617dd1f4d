"""The README's five-minute walkthrough runs verbatim, in order, as a new user runs it: ``livelora serve`` on a
fresh store (no keys, the evaluation gate on, as installed), the Python blocks in one interpreter session, the
shell lines in a shell with ``livelora`` on PATH. Only the URL changes (the server listens on a free port). The
chat example of docs/serving.md runs first against the same server. Slow: the first learned version takes a
minute or several on 2 CPU cores (``-m 'not slow'`` skips it)."""

from __future__ import annotations

import json
import re
import subprocess

import httpx
import pytest
from _doc_blocks import REPO, blocks, section_blocks
from harness.docs import run_bash, run_python, serve_process

from livelora.clients.types.learning import LearningStatus

pytestmark = [pytest.mark.slow, pytest.mark.live]
WALKTHROUGH = ("## Five minutes: chat, rate, watch a new version being served", "## Documentation")
#: The walkthrough's factual questions and their accepted answers (a word anywhere in the reply, case folded).
FACTS = {
    "What is the capital of France?": "paris",
    "What is the capital of Italy?": "rome",
    "Name a primary colour.": "red|blue|yellow",
    "How many legs does a spider have?": "8|eight",
    "What is 2 + 3?": "5|five",
    "Say hello in Spanish.": "hola",
    "What do bees make?": "honey",
    "Which planet is closest to the sun?": "mercury",
    "What is the opposite of hot?": "cold",
}


def fact_replies(chat) -> dict[str, str]:
    """The greedy replies (the walkthrough's ``chat``) to the questions of :data:`FACTS`."""
    return {q: chat(q)[0].choices[0].message.content for q in FACTS}


def recording(chat, answered: dict[str, tuple[str, str]]):
    """The walkthrough's ``chat``, unchanged, that also keeps each question's reply and the version that gave it
    in ``answered`` (question → (reply text, version))."""

    def chat_and_keep(question, **kw):
        reply, version = chat(question, **kw)
        answered[question] = (reply.choices[0].message.content, version)
        return reply, version

    return chat_and_keep


def right(replies: dict[str, str]) -> set[str]:
    """The questions whose reply holds an accepted answer (a word, case folded)."""
    return {q for q, text in replies.items() if re.search(rf"\b({FACTS[q]})\b", text.lower())}


@pytest.fixture
def fresh_serve(tmp_path):
    with serve_process(tmp_path, installed=True) as serve:
        yield serve


@pytest.mark.timeout(1800)
def test_readme_walkthrough_runs_in_order_on_a_fresh_store(fresh_serve, tmp_path):
    url = fresh_serve.url
    serving_chat = blocks(REPO / "docs" / "serving.md")[2]
    assert serving_chat.lang == "python" and "with_raw_response" in serving_chat.code
    printed = run_python(serving_chat.code, url, {}).splitlines()
    assert "Paris" in printed[0] and printed[1] == "base livelora-base"

    steps = section_blocks(REPO / "README.md", *WALKTHROUGH)
    assert [b.lang for b in steps] == ["python", "python", "python", "bash", "python"]
    ns: dict = {}
    chat, rate, watch, cli, session = steps

    printed = run_python(chat.code, url, ns).splitlines()
    assert printed[0].strip() and printed[1] == "base livelora-base"
    # The base model's replies to FACTS are the ones the walkthrough itself gets: its first chat asks the first
    # question, its rating loop the other eight (greedy, max_tokens 40, as asked again of @1 below), so they are
    # kept as it runs instead of asked a second time (9 chats of 40 tokens fewer while the base measurement runs).
    answered = {"What is the capital of France?": (ns["reply"].choices[0].message.content, "base")}
    ns["chat"] = recording(ns["chat"], answered)

    printed = run_python(rate.code, url, ns).splitlines()
    assert len(printed) == 8 and all(line.startswith("200 smollm2-135m-instruct ") for line in printed)
    assert set(answered) == set(FACTS) and {v for _, v in answered.values()} == {"base"}, answered
    at_base = {q: text for q, (text, _) in answered.items()}

    printed = run_python(watch.code, url, ns).splitlines()
    assert ns["version"] == "smollm2-135m-instruct@1", "no learned version within the loop's 15 minutes"
    assert printed[0].startswith("smollm2-135m-instruct@1 -> ")
    assert ns["reply"].system_fingerprint == "livelora-smollm2-135m-instruct@1"
    # the learned version keeps answering the walkthrough's factual questions that the base model answered right
    at_1 = fact_replies(ns["chat"])
    lost = {q: (at_base[q], at_1[q]) for q in right(at_base) - right(at_1)}  # judged at the end
    # what the README says GET /v1/learning shows: what the step trained on, and the version served
    status = LearningStatus.model_validate(httpx.get(f"{url}/v1/learning/smollm2-135m-instruct", timeout=60).json())
    assert status.serving is not None and status.last is not None and status.last.stage == "published"
    assert re.fullmatch(
        r"kto step on \d+ event\(s\): a (full batch \(8 start a step\)|partial batch .+)", status.last.detail
    )

    outputs = []
    for line in cli.code.strip().splitlines():
        done = subprocess.run(line, shell=True, env=fresh_serve.env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{line}\n{done.stdout}{done.stderr}"
        outputs.append(" ".join(done.stdout.split()))
    assert "created endpoint prod → smollm2-135m-instruct (pinned), serving base" in outputs[0]
    assert outputs[1].startswith("prod: base → smollm2-135m-instruct@1 (promote")
    assert outputs[2].startswith("prod: smollm2-135m-instruct@1 → base (rollback")
    assert all(word in outputs[3] for word in ("create", "promote", "rollback"))
    assert "smollm2-135m-instruct@1" in outputs[4]

    printed = run_python(session.code, url, ns).splitlines()
    losses = [float(line.split()[1]) for line in printed[:4]]
    assert losses[-1] < losses[0]
    assert "Paris" in printed[-1]

    # docs/live-loop.md's signals, on the same server after the walkthrough (open mode, as the page assumes)
    signals = blocks(REPO / "docs" / "live-loop.md")[0]
    assert signals.lang == "bash" and "/v1/feedback" in signals.code
    answers, text, decoder = [], run_bash(signals.code, url, fresh_serve.env, tmp_path).strip(), json.JSONDecoder()
    while text:
        answer, end = decoder.raw_decode(text)
        answers.append(answer)
        text = text[end:].lstrip()
    assert len(answers) == 3 and not any("error" in a for a in answers), answers

    # The learned version must keep answering the walkthrough's factual questions the base model answered right.
    # Known defect, open (#45): these are the questions the 8 ratings were given on, and with the update that keeps
    # the free-form capability set's answers (rehearsal + KL, warm-up, the gate's free-form check), @1 still lost
    # "What is 2 + 3?" ("To add 2 and 3, you simply add them together.") on an AMD EPYC (AVX-512) here.
    # bench/walkthrough_step.py reproduces the step offline: @1 loses the right answer the rater disliked for its
    # length (both KL terms are zero at a first step); a warm-up over 10 steps kept it (docs/live-loop.md, "The
    # walkthrough's first step"). Reported as an expected failure, with the replies, until the update keeps them;
    # a machine where @1 keeps them passes.
    if lost:
        pytest.xfail(f"known defect: @1 lost answers the base model gave (question: (base, @1)): {lost}")
