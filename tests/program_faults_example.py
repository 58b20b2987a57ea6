"""An agent program for the fault tests: one call, then, for a task whose metadata says
so, the process ends under it (as ``os._exit`` in a library or a crash in native code)."""

import os

import openai


def run(task, base_url, api_key):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task["question"]}], max_tokens=4
    )
    if task["metadata"].get("exit"):
        os._exit(3)
    return 1.0
