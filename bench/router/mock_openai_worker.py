"""An instant OpenAI-compatible worker for peer routers (smg, sglang-router).

Streams `max_tokens` one-word chunks at once (no model), so that a router in
front of it is what costs. Serves what those routers probe: /health,
/v1/models, /get_model_info, /get_server_info, /get_load.
usage: mock_openai_worker.py PORT MODEL_NAME
"""
import json
import sys

from aiohttp import web

PORT = int(sys.argv[1])
MODEL = sys.argv[2] if len(sys.argv) > 2 else "mock"
INFO = {
    "model_path": MODEL,
    "tokenizer_path": MODEL,
    "is_generation": True,
    "served_model_name": MODEL,
    "max_total_num_tokens": 1 << 20,
    "disaggregation_mode": "null",
}


def frame(obj):
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def chunk(kind, i, word, finish):
    if kind == "chat":
        delta = {"content": word} if word is not None else {}
        if i == 0:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": word or "", "finish_reason": finish}
        obj = "text_completion"
    return frame({"id": "mock", "object": obj, "created": 0, "model": MODEL, "choices": [choice]})


async def complete(req, kind):
    body = await req.json()
    n = max(1, int(body.get("max_tokens") or body.get("max_completion_tokens") or 16))
    words = [f" w{i % 1000}" for i in range(n)]
    usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
    if not body.get("stream"):
        text = "".join(words)
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length"}
        return web.json_response({"id": "mock", "object": "chat.completion", "created": 0,
                                  "model": MODEL, "choices": [choice], "usage": usage})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(req)
    for i, w in enumerate(words):
        await resp.write(chunk(kind, i, w, None))
    await resp.write(chunk(kind, n, None, "length"))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def chat(req):
    return await complete(req, "chat")


async def completions(req):
    return await complete(req, "text")


async def ok(_):
    return web.Response(text="ok")


async def info(_):
    return web.json_response(INFO)


async def server_info(_):
    return web.json_response({**INFO, "internal_states": [{"last_gen_throughput": 0.0}]})


async def models(_):
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "mock"}]})


async def load(_):
    return web.json_response({"load": 0})


app = web.Application()
app.router.add_post("/v1/chat/completions", chat)
app.router.add_post("/v1/completions", completions)
for p in ("/health", "/health_generate", "/flush_cache", "/readiness", "/liveness"):
    app.router.add_get(p, ok)
for p in ("/get_model_info", "/model_info"):
    app.router.add_get(p, info)
for p in ("/get_server_info", "/server_info"):
    app.router.add_get(p, server_info)
app.router.add_get("/v1/models", models)
app.router.add_get("/get_load", load)

if __name__ == "__main__":
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=PORT, access_log=None, print=None)
