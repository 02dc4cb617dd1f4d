"""Try the OpenAI-compatible clients people use against a running gateway, with their default settings.

    python bench/clients_check.py [--url http://127.0.0.1:8000] [--model smollm2-135m-instruct]

openai-python (chat, stream, legacy completions with logprobs, ``extra_body`` vLLM extensions, the
penalties), LangChain's ``ChatOpenAI`` (invoke, stream, batch, the penalties) and LiteLLM (``completion``,
streaming, the penalties) are imported only if installed
(``pip install langchain-openai litellm``; not livelora dependencies). Prints one line per check: the client, its
version, ``ok`` or the error. The results go to docs/clients.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
from collections.abc import Callable


def check(name: str, dist: str, fn: Callable[[], object]) -> None:
    try:
        version = md.version(dist)
    except md.PackageNotFoundError:
        print(f"{name}: not installed")
        return
    try:
        print(f"{name} {version}: ok {str(fn())[:60]!r}")
    except Exception as exc:  # a report, not a test: every failure is printed
        print(f"{name} {version}: FAILED {type(exc).__name__}: {str(exc)[:200]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    a = ap.parse_args()
    base, model, q = a.url + "/v1", a.model, [{"role": "user", "content": "What is the capital of France?"}]

    def openai_calls():
        from openai import OpenAI

        c = OpenAI(base_url=base, api_key="unused")
        r = c.chat.completions.create(model=model, messages=q, max_tokens=8)
        "".join(
            x.choices[0].delta.content or ""
            for x in c.chat.completions.create(model=model, messages=q, stream=True, max_tokens=8)
            if x.choices
        )
        c.completions.create(model=model, prompt="The sky is", max_tokens=4, logprobs=1, echo=True)
        cont = [*q, {"role": "assistant", "content": "The capital"}]
        c.chat.completions.create(
            model=model,
            messages=cont,
            max_tokens=8,
            extra_body={"continue_final_message": True, "add_generation_prompt": False, "min_tokens": 2},
        )
        penalties = {"frequency_penalty": 0.5, "presence_penalty": 0.3}
        vllm = {"repetition_penalty": 1.2, "min_p": 0.05, "top_k": 20}
        c.chat.completions.create(model=model, messages=q, max_tokens=8, extra_body=vllm, **penalties)
        return r.choices[0].message.content

    def langchain_calls():
        from langchain_openai import ChatOpenAI

        llm = ChatOpenAI(model=model, base_url=base, api_key="unused", max_tokens=8)
        llm.batch(["Hi", "Hello"])
        "".join(str(c.content) for c in llm.stream("Hi"))
        penalties = {"frequency_penalty": 0.5, "presence_penalty": 0.3}
        ChatOpenAI(model=model, base_url=base, api_key="unused", **penalties).invoke("Hi")
        return llm.invoke("What is the capital of France?").content

    def litellm_calls():
        import litellm

        kw = {"model": f"openai/{model}", "api_base": base, "api_key": "unused", "messages": q, "max_tokens": 8}
        "".join(c.choices[0].delta.content or "" for c in litellm.completion(stream=True, **kw))
        litellm.completion(frequency_penalty=0.5, presence_penalty=0.3, **kw)
        return litellm.completion(**kw).choices[0].message.content

    check("openai-python", "openai", openai_calls)
    check("LangChain ChatOpenAI", "langchain-openai", langchain_calls)
    check("LiteLLM", "litellm", litellm_calls)


if __name__ == "__main__":
    main()
