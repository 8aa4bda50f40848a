"""Schemathesis hooks for tests/tests/openapi.rs (loaded through
SCHEMATHESIS_HOOKS): every generation is bounded to a few tokens, so that
the fuzz spends its time on many requests, not on long generations of a
small model on two cores. Only the length fields are touched, and only
when they hold a number (or nothing); other invalid values go out as
generated.
"""

import os

import schemathesis

MAX_TOKENS = int(os.environ.get("TANDEM_FUZZ_MAX_TOKENS", "4"))

# Per route, the fields that bound a generation (the first one is set
# when none is given).
LENGTH_FIELDS = {
    "/v1/chat/completions": ("max_completion_tokens", "max_tokens"),
    "/v1/completions": ("max_tokens",),
    "/v1/responses": ("max_output_tokens",),
}


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


@schemathesis.hook
def before_call(context, case, kwargs):
    fields = LENGTH_FIELDS.get(case.operation.path)
    body = case.body
    if not fields or not isinstance(body, dict):
        return
    numbers = [f for f in fields if _is_int(body.get(f))]
    for f in numbers:
        if body[f] > MAX_TOKENS:
            body[f] = MAX_TOKENS
    if not numbers:
        for f in fields:
            if body.get(f) is None:
                body[f] = MAX_TOKENS
                break
