import json
import openai

ADD = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {}, "b": {}}}},
}


def run(task, base_url, api_key):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": task["question"]}]
    for _ in range(2):
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=[ADD], max_tokens=12
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            args = json.loads(call.function.arguments)
            total = str(args.get("a", 0) + args.get("b", 0))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": total})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "Check it and answer again."})
    return message.content or ""


def score(task, answer):
    return float(task["answer"].strip() in answer)
