"""Real, unmodified OpenAI clients against a Tandem server.

Usage: python clients.py BASE_URL [CHECK ...]

BASE_URL is the server's API root (http://127.0.0.1:8000/v1). Each check
drives one client library the way its users do and asserts on what comes
back; the script prints one line per check and exits non-zero if any
failed. The model is tiny (SmolLM2-135M), so checks rely on what the
server guarantees (grammar-constrained JSON and tool calls), not on the
model's judgement.
"""

import asyncio
import json
import sys
import runner

from pydantic import BaseModel, Field

BASE = ""
MODEL = ""


class Pet(BaseModel):
    # Bounded, so the grammar ends the answer well within max_tokens.
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=99)


class Lenient(BaseModel):
    """Any JSON object validates (for modes that only promise an object)."""

    model_config = {"extra": "allow"}


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def openai_client():
    from openai import OpenAI

    return OpenAI(base_url=BASE, api_key="unused", max_retries=0, timeout=120)


def check_openai_parse():
    """chat.completions.parse with a pydantic model (json_schema, strict)."""
    c = openai_client()
    r = c.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Invent a pet. Reply in JSON."}],
        response_format=Pet,
        max_tokens=120,
        temperature=0,
    )
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet), r
    assert r.choices[0].finish_reason == "stop", r
    return f"parsed {pet!r}"


def check_openai_stream_tools():
    """Streaming tool calls: deltas assembled as the SDK's users do."""
    c = openai_client()
    stream = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        # One call: SmolLM2 is no tool model and, free to add parallel
        # calls, may add them until max_tokens (Qwen's stop after two in
        # tests/clients/ai_sdk.cjs and pydantic_ai_checks.py).
        parallel_tool_calls=False,
        stream=True,
        max_tokens=120,
        temperature=0,
    )
    calls = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        for d in ch.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            if d.id:
                call["id"] = d.id
            if d.function and d.function.name:
                call["name"] += d.function.name
            if d.function and d.function.arguments:
                call["arguments"] += d.function.arguments
        finish = ch.finish_reason or finish
    assert finish == "tool_calls", finish
    assert calls and all(c["id"] for c in calls.values()), calls
    call = calls[0]
    assert call["name"] == "get_weather", call
    args = json.loads(call["arguments"])
    assert isinstance(args.get("city"), str), args
    # The conversation goes on with the call and its result in the history.
    r = c.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": call["name"], "arguments": call["arguments"]},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C"},
        ],
        tools=[WEATHER_TOOL],
        max_tokens=30,
        temperature=0,
    )
    assert r.choices[0].message.content or r.choices[0].message.tool_calls, r
    return f"{len(calls)} streamed call(s): {call['name']}({call['arguments']})"


def check_openai_responses():
    """responses.create: text, streaming events, a forced function call and
    structured output through text.format."""
    c = openai_client()
    r = c.responses.create(model=MODEL, input="Say hello.", max_output_tokens=16, temperature=0)
    assert r.output_text, r
    events = list(
        c.responses.create(
            model=MODEL, input="Say hello.", max_output_tokens=16, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created", kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == r.output_text, (streamed, r.output_text)
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": WEATHER_TOOL["function"]["parameters"],
        "strict": True,
    }
    t = c.responses.create(
        model=MODEL,
        input="Weather in Oslo?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
    )
    calls = [o for o in t.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather", t
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    p = c.responses.parse(
        model=MODEL, input="Invent a pet.", text_format=Pet, max_output_tokens=120, temperature=0
    )
    assert isinstance(p.output_parsed, Pet), p
    return f"text {r.output_text!r}, {len(events)} events, call {calls[0].arguments}, {p.output_parsed!r}"


def langchain_chat(**kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=BASE, api_key="unused", model=MODEL, temperature=0, max_tokens=120,
        max_retries=0, **kw
    )


def check_langchain_structured():
    """with_structured_output in all three methods, and bind_tools."""
    from langchain_core.tools import tool

    llm = langchain_chat()
    # json_object mode bounds nothing but the syntax: without a penalty the
    # tiny model nests objects until max_tokens.
    lenient = langchain_chat(presence_penalty=1.5)
    out = []
    for method, schema, model in [
        ("json_schema", Pet, llm),
        ("function_calling", Pet, llm),
        ("json_mode", Lenient, lenient),
    ]:
        res = model.with_structured_output(schema, method=method).invoke(
            "Invent a pet and reply in JSON."
        )
        assert isinstance(res, schema), (method, res)
        out.append(f"{method}: {res!r}")

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return "sunny"

    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Rome?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather", msg
    assert isinstance(msg.tool_calls[0]["args"].get("city"), str), msg.tool_calls
    out.append(f"bind_tools: {msg.tool_calls[0]['args']}")
    # The Responses API path of the same client.
    r = langchain_chat(use_responses_api=True).invoke("Say hello.")
    assert r.text, r
    out.append(f"responses: {r.text!r}")
    return "; ".join(out)


def check_agents_sdk():
    """The OpenAI Agents SDK on its default (Responses) model, calling a
    function tool and finishing with an answer."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    called = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        called.append(city)
        return f"It is sunny in {city}."

    model = OpenAIResponsesModel(
        model=MODEL, openai_client=AsyncOpenAI(base_url=BASE, api_key="unused", max_retries=0)
    )
    agent = Agent(
        name="weather",
        instructions="Answer weather questions with the get_weather tool.",
        tools=[get_weather],
        model=model,
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
    )

    async def run():
        return await Runner.run(agent, "What is the weather in Lisbon?", max_turns=4)

    result = asyncio.run(run())
    assert called, "the tool was never called"
    assert isinstance(result.final_output, str) and result.final_output, result
    return f"tool called with {called}, final output {result.final_output!r}"


def check_instructor():
    """instructor in TOOLS and JSON modes."""
    import instructor

    out = []
    for mode, model in [(instructor.Mode.TOOLS, Pet), (instructor.Mode.JSON, Lenient)]:
        client = instructor.from_openai(openai_client(), mode=mode)
        res = client.chat.completions.create(
            model=MODEL,
            response_model=model,
            messages=[{"role": "user", "content": "Invent a pet."}],
            max_tokens=120,
            temperature=0,
            presence_penalty=1.5 if model is Lenient else 0,
            max_retries=1,
        )
        assert isinstance(res, model), (mode, res)
        out.append(f"{mode.name}: {res!r}")
    return "; ".join(out)


CHECKS = {
    "openai_parse": check_openai_parse,
    "openai_stream_tools": check_openai_stream_tools,
    "openai_responses": check_openai_responses,
    "langchain": check_langchain_structured,
    "agents": check_agents_sdk,
    "instructor": check_instructor,
}


def configure(base, model):
    global BASE, MODEL
    BASE, MODEL = base, model



if __name__ == "__main__":
    sys.exit(runner.run(__doc__, CHECKS, configure))
