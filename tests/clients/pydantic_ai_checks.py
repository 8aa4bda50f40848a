"""pydantic-ai, unmodified, against a Tandem server (its OpenAI Chat model).

Usage: python pydantic_ai_checks.py BASE_URL [CHECK ...]

Run with the venv of tests/clients/requirements-pydantic-ai.txt (pydantic-ai
needs openai 3, which the main client venv cannot hold). One line per
check, then "N of M client checks passed"; exits non-zero if any failed.
Tool checks need a model that writes Hermes tool calls (Qwen2.5); they rely
on what the server guarantees (grammars), not on the model's judgement.
"""

import sys
import runner

from pydantic import BaseModel, Field

BASE = ""
MODEL = ""


class Pet(BaseModel):
    # Bounded, so the grammar ends the answer well within max_tokens.
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=99)


def model():
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=BASE, api_key="unused"))


def check_output_with_hints():
    """A structured answer (pydantic-ai's output tool, a forced call) with
    the current Chat Completions fields set (issue #41.2.2: a 400)."""
    from pydantic_ai import Agent

    agent = Agent(model(), output_type=Pet)
    r = agent.run_sync(
        "Invent a pet.",
        model_settings={
            "temperature": 0,
            "max_tokens": 120,
            "openai_prompt_cache_key": "tandem-clients",
            "openai_text_verbosity": "low",
        },
    )
    assert isinstance(r.output, Pet), r
    return f"{r.output!r}"


def check_logprobs():
    """Logprobs of a json_schema answer (issue #41.2.1: null in
    top_logprobs under the constraint)."""
    from pydantic_ai import Agent, NativeOutput

    agent = Agent(model(), output_type=NativeOutput(Pet))
    r = agent.run_sync(
        "Invent a pet. Reply in JSON.",
        model_settings={
            "temperature": 0,
            "max_tokens": 120,
            "openai_logprobs": True,
            "openai_top_logprobs": 5,
        },
    )
    assert isinstance(r.output, Pet), r
    logprobs = r.response.provider_details["logprobs"]
    assert logprobs, r.response
    for t in logprobs:
        numbers = [t["logprob"]] + [a["logprob"] for a in t["top_logprobs"]]
        assert all(isinstance(x, float) for x in numbers), t
    return f"{len(logprobs)} tokens, all numbers; {r.output!r}"


def check_forced_call_cut():
    """A forced call cut by max_tokens (issue #41.2.4: raw template text in
    content, no tool call): pydantic-ai sees the partial call and says so."""
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import IncompleteToolCall

    agent = Agent(model(), output_type=Pet)
    try:
        r = agent.run_sync("Invent a pet.", model_settings={"temperature": 0, "max_tokens": 16})
    except IncompleteToolCall as e:
        return f"IncompleteToolCall: {str(e)[:60]}..."
    raise AssertionError(f"no IncompleteToolCall; got {r.output!r}")


def check_parallel_required():
    """`required` with two things to look up (issue #41.2.5: never a second
    call): both calls in one response, through pydantic-ai's direct model
    request (an agent refuses `required` for its whole run)."""
    from pydantic_ai import ModelRequest
    from pydantic_ai.direct import model_request_sync
    from pydantic_ai.models import ModelRequestParameters
    from pydantic_ai.tools import ToolDefinition

    weather = ToolDefinition(
        name="get_weather",
        description="Current weather in a city.",
        parameters_json_schema={
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    )
    response = model_request_sync(
        model(),
        [
            ModelRequest.user_text_prompt(
                "What is the weather in Paris and in Oslo? Call the tool once for each city."
            )
        ],
        model_settings={"temperature": 0, "max_tokens": 120, "tool_choice": "required"},
        model_request_parameters=ModelRequestParameters(function_tools=[weather]),
    )
    calls = [p for p in response.parts if p.part_kind == "tool-call"]
    assert len(calls) >= 2, response
    assert response.finish_reason == "tool_call", response
    return f"one response, {len(calls)} calls: {[c.args for c in calls]}"


CHECKS = {
    "output_with_hints": check_output_with_hints,
    "logprobs": check_logprobs,
    "forced_call_cut": check_forced_call_cut,
    "parallel_required": check_parallel_required,
}


def configure(base, model):
    global BASE, MODEL
    BASE, MODEL = base, model



if __name__ == "__main__":
    sys.exit(runner.run(__doc__, CHECKS, configure))
