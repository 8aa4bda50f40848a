// The Vercel AI SDK (`ai` with `@ai-sdk/openai`'s Chat Completions model),
// unmodified, against a Tandem server.
//
// Usage: NODE_PATH=<js-clients>/node_modules node ai_sdk.cjs BASE_URL [CHECK ...]
//
// BASE_URL is the server's API root (http://127.0.0.1:8000/v1). The
// packages are pinned in tests/clients/js (scripts/js-clients.sh installs
// them). Each check drives the SDK as its users do and asserts on what
// comes back; one line per check, then "N of M client checks passed", and
// a non-zero exit if any failed. Tool checks need a model that writes
// Hermes tool calls (Qwen2.5); the answers rely on what the server
// guarantees (grammars), not on the model's judgement.
"use strict";

const { generateText, streamText, Output, tool, jsonSchema } = require("ai");
const { createOpenAI } = require("@ai-sdk/openai");
const { z } = require("zod");

let BASE = "";
let MODEL = "";

function chatModel() {
  return createOpenAI({ baseURL: BASE, apiKey: "unused" }).chat(MODEL);
}

function assert(cond, what) {
  if (!cond) throw new Error(`assertion failed: ${what}`);
}

const common = { temperature: 0, maxRetries: 0 };

const pet = z.object({ name: z.string().max(12), age: z.number().int().min(0).max(99) });

/// Every logprob in the SDK's validated `providerMetadata.openai.logprobs`
/// is a number (a null fails the SDK's own response schema first).
function allNumbers(logprobs) {
  assert(Array.isArray(logprobs) && logprobs.length > 0, `logprobs ${JSON.stringify(logprobs)}`);
  for (const t of logprobs) {
    assert(typeof t.logprob === "number" && Number.isFinite(t.logprob), JSON.stringify(t));
    for (const a of t.top_logprobs) {
      assert(typeof a.logprob === "number" && Number.isFinite(a.logprob), JSON.stringify(t));
    }
  }
  return logprobs.length;
}

// Issue #41.2.1: top_logprobs under a json_schema constraint held null.
async function checkLogprobs() {
  const args = {
    ...common,
    model: chatModel(),
    prompt: "Invent a pet. Reply in JSON.",
    output: Output.object({ schema: pet }),
    maxOutputTokens: 120,
    providerOptions: { openai: { logprobs: 5 } },
  };
  const r = await generateText(args);
  assert(pet.safeParse(r.output).success, JSON.stringify(r.output));
  const n = allNumbers(r.providerMetadata.openai.logprobs);
  const s = streamText({ ...args, onError: () => {} });
  for await (const part of s.fullStream) {
    if (part.type === "error") throw part.error;
  }
  const streamed = allNumbers((await s.providerMetadata).openai.logprobs);
  return `${n} tokens, ${streamed} streamed, all numbers; ${JSON.stringify(r.output)}`;
}

// Issue #41.2.2: current Chat Completions fields were a 400.
async function checkHintFields() {
  const r = await generateText({
    ...common,
    model: chatModel(),
    prompt: "Say hello.",
    maxOutputTokens: 16,
    providerOptions: {
      openai: { promptCacheKey: "tandem-clients", safetyIdentifier: "user-1", textVerbosity: "low" },
    },
  });
  assert(r.text.length > 0, JSON.stringify(r));
  return `text ${JSON.stringify(r.text)}`;
}

const getTime = tool({
  description: "The current time in a time zone.",
  inputSchema: z.object({ tz: z.string(), format: z.string() }),
});

// Issue #41.2.4: a forced call cut by max_tokens came back as raw template
// text (no tool call), and streamed no tool-call delta at all.
async function checkForcedCallCut() {
  const args = {
    ...common,
    model: chatModel(),
    prompt: "What time is it in UTC?",
    tools: { get_time: getTime },
    toolChoice: { type: "tool", toolName: "get_time" },
    // Cut inside the arguments: `{"tz":"UTC","format":"%`.
    maxOutputTokens: 20,
  };
  const r = await generateText(args);
  assert(r.finishReason === "length", `finishReason ${r.finishReason}`);
  assert(!r.text.includes("<tool_call>"), `raw template text: ${JSON.stringify(r.text)}`);
  const calls = r.content.filter((p) => p.type === "tool-call" || p.type === "tool-error");
  assert(calls.length > 0 && calls.every((p) => p.toolName === "get_time"), JSON.stringify(r.content));
  const s = streamText({ ...args, onError: () => {} });
  let start = null;
  let text = "";
  const deltas = [];
  for await (const part of s.fullStream) {
    if (part.type === "error") throw part.error;
    if (part.type === "tool-input-start" && start === null) start = part;
    if (part.type === "tool-input-delta") deltas.push(part.delta);
    if (part.type === "text-delta") text += part.text;
  }
  assert(start !== null && start.toolName === "get_time", "no tool-input-start for get_time");
  // The arguments as they were generated, in several pieces.
  assert(deltas.length > 1 && deltas.join("").startsWith('{"tz"'), `argument deltas ${JSON.stringify(deltas)}`);
  assert(!text.includes("<tool_call>"), `raw template text streamed: ${JSON.stringify(text)}`);
  const finish = await s.finishReason;
  assert(finish === "length", `streamed finishReason ${finish}`);
  return `unstreamed ${calls[0].type} ${JSON.stringify(calls[0].input)}, streamed ${start.toolName}(${deltas.join("")})`;
}

const weatherSchema = {
  type: "object",
  properties: { city: { type: "string" } },
  required: ["city"],
};

// Issue #41.2.3: open schemas let the model invent keys (forced tool
// arguments, strict json_schema output).
async function checkClosedSchemas() {
  const r = await generateText({
    ...common,
    model: chatModel(),
    prompt: "What is the weather in Paris?",
    tools: { get_weather: tool({ description: "Current weather in a city.", inputSchema: jsonSchema(weatherSchema) }) },
    toolChoice: "required",
    maxOutputTokens: 60,
  });
  assert(r.toolCalls.length > 0, JSON.stringify(r.content));
  for (const c of r.toolCalls) {
    assert(JSON.stringify(Object.keys(c.input)) === '["city"]', `invented keys: ${JSON.stringify(c.input)}`);
  }
  const hero = await generateText({
    ...common,
    model: chatModel(),
    prompt: "Describe a hero as JSON with a name, a skill and an age.",
    output: Output.object({
      schema: jsonSchema({ type: "object", properties: { name: { type: "string", maxLength: 20 } }, required: ["name"] }),
    }),
    maxOutputTokens: 80,
  });
  assert(JSON.stringify(Object.keys(hero.output)) === '["name"]', `invented keys: ${JSON.stringify(hero.output)}`);
  return `tool ${JSON.stringify(r.toolCalls[0].input)}, strict output ${JSON.stringify(hero.output)}`;
}

// Issue #41.2.5: `required` never yielded a second parallel call.
async function checkParallelRequired() {
  const r = await generateText({
    ...common,
    model: chatModel(),
    prompt: "What is the weather in Paris and in Oslo? Call the tool once for each city.",
    tools: { get_weather: tool({ description: "Current weather in a city.", inputSchema: jsonSchema(weatherSchema) }) },
    toolChoice: "required",
    maxOutputTokens: 120,
  });
  const cities = r.toolCalls.map((c) => c.input.city);
  assert(cities.length >= 2, `calls: ${JSON.stringify(r.content)}`);
  assert(r.finishReason === "tool-calls", `finishReason ${r.finishReason}`);
  return `calls for ${JSON.stringify(cities)}`;
}

const CHECKS = {
  logprobs: checkLogprobs,
  hint_fields: checkHintFields,
  forced_call_cut: checkForcedCallCut,
  closed_schemas: checkClosedSchemas,
  parallel_required: checkParallelRequired,
};

async function main() {
  const argv = process.argv.slice(2);
  if (argv.length < 1) {
    console.log("usage: node ai_sdk.cjs BASE_URL [CHECK ...]");
    return 2;
  }
  BASE = argv[0].replace(/\/$/, "");
  const names = argv.length > 1 ? argv.slice(1) : Object.keys(CHECKS);
  const models = await (await fetch(`${BASE}/models`)).json();
  MODEL = models.data[0].id;
  const failed = [];
  for (const name of names) {
    try {
      if (!CHECKS[name]) throw new Error(`no check ${name}`);
      console.log(`ok   ${name}: ${await CHECKS[name]()}`);
    } catch (e) {
      failed.push(name);
      const detail = e && e.responseBody ? `\n    response: ${e.responseBody}` : "";
      console.log(`FAIL ${name}:\n    ${(e && e.stack) || e}${detail}`);
    }
  }
  console.log(`${names.length - failed.length} of ${names.length} client checks passed`);
  return failed.length ? 1 : 0;
}

main().then(
  (code) => process.exit(code),
  (e) => {
    console.log(`FAIL: ${(e && e.stack) || e}`);
    process.exit(1);
  },
);
