// The gateway's page: the functions the given keys open, polled every POLL_MS, and a chat that streams.
// Plain browser JavaScript, no build step. Keys live in sessionStorage (this tab) and go out only as the
// bearer token of this gateway's own endpoints, exactly as an OpenAI client sends them.
"use strict";

const POLL_MS = 2000;
const $ = (id) => document.getElementById(id);
const keys = JSON.parse(sessionStorage.getItem("onnxfn-keys") || "[]");
const functions = new Map(); // name -> {row, key, tokensOut, at, rate}
let history = [];
let streaming = false;

$("base").textContent = `${location.origin}/v1`;

function bearer(key) {
  return key ? { authorization: `Bearer ${key}` } : {};
}

function saveKeys() {
  sessionStorage.setItem("onnxfn-keys", JSON.stringify(keys));
  $("keys").replaceChildren(...keys.map((key) => {
    const chip = document.createElement("span");
    chip.className = "key";
    chip.textContent = `…${key.slice(-4)}`;
    return chip;
  }));
}

async function listWith(key) {
  const response = await fetch("/gateway/functions", { headers: bearer(key) });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error ? body.error.message : `HTTP ${response.status}`);
  return body;
}

async function refresh() {
  const seen = new Map();
  let rejected = null;
  for (const key of [...keys, ""]) {
    try {
      const listed = await listWith(key);
      for (const row of listed.functions) {
        if (!seen.has(row.name)) seen.set(row.name, { row, key, at: listed.at });
      }
    } catch (error) {
      if (key) rejected = error.message;
    }
  }
  for (const [name, entry] of seen) {
    const before = functions.get(name);
    const tokens = entry.row.tokens_out;
    if (before && tokens !== null && before.tokensOut !== null && tokens >= before.tokensOut && entry.at > before.at) {
      entry.rate = (tokens - before.tokensOut) / (entry.at - before.at);
    } else {
      entry.rate = entry.row.state === "ready" && before ? before.rate : null;
    }
    entry.tokensOut = tokens;
  }
  functions.clear();
  for (const [name, entry] of seen) functions.set(name, entry);
  render(rejected);
}

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function render(rejected) {
  const rows = [...functions.values()].map(({ row, rate }) => {
    const tr = document.createElement("tr");
    tr.dataset.name = row.name;
    const state = row.state === "idle" && row.wake ? `idle (${row.wake})` : row.state;
    tr.append(
      cell(row.name),
      cell(row.task),
      cell(state, `state ${row.state}`),
      cell(row.requests === null ? "-" : String(Math.round(row.requests)), "num requests"),
      cell(row.ttft_p50_s === null ? "-" : `${(row.ttft_p50_s * 1000).toFixed(0)} ms`, "num ttft"),
      cell(rate === null || rate === undefined ? "-" : rate.toFixed(1), "num rate"),
      cell(String(row.in_flight), "num"),
    );
    return tr;
  });
  $("functions").tBodies[0].replaceChildren(...rows);
  const count = functions.size;
  $("status").textContent = rejected
    ? `a key was refused: ${rejected}`
    : count ? `${count} function${count > 1 ? "s" : ""}, updated ${new Date().toLocaleTimeString()}` : "no function opens with these keys";
  const chosen = $("model").value;
  const chats = [...functions.values()].filter(({ row }) => row.task === "chat" || row.task === "completion");
  $("model").replaceChildren(...chats.map(({ row }) => new Option(`${row.name} (${row.task})`, row.name)));
  if (chats.some(({ row }) => row.name === chosen)) $("model").value = chosen;
  $("send").disabled = streaming || chats.length === 0;
}

function addTurn(role, text) {
  const div = document.createElement("div");
  div.className = `turn ${role}`;
  div.textContent = text;
  $("conversation").append(div);
  $("conversation").scrollTop = $("conversation").scrollHeight;
  return div;
}

// One streamed reply: Server-Sent Events, `data: {...}` per chunk, then `data: [DONE]`.
async function stream(entry, text, bubble) {
  const chat = entry.row.task === "chat";
  const body = chat
    ? { model: entry.row.name, messages: history, stream: true }
    : { model: entry.row.name, prompt: text, stream: true };
  const response = await fetch(chat ? "/v1/chat/completions" : "/v1/completions", {
    method: "POST",
    headers: { "content-type": "application/json", ...bearer(entry.key) },
    body: JSON.stringify(body),
  });
  if (!response.ok) {
    const failed = await response.json().catch(() => ({}));
    throw new Error(failed.error ? failed.error.message : `HTTP ${response.status}`);
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let pending = "";
  let reply = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    pending += decoder.decode(value, { stream: true });
    const events = pending.split("\n\n");
    pending = events.pop();
    for (const event of events) {
      const data = event.replace(/^data: /, "");
      if (data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = (chunk.choices || [])[0];
      const piece = choice ? (chat ? (choice.delta && choice.delta.content) || "" : choice.text || "") : "";
      reply += piece;
      bubble.textContent = reply;
    }
  }
  return reply;
}

$("key-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const key = $("key").value.trim();
  $("key").value = "";
  if (!key || keys.includes(key)) return;
  try {
    await listWith(key);
  } catch (error) {
    $("key-note").textContent = `that key was not added: ${error.message}`;
    return;
  }
  keys.push(key);
  saveKeys();
  $("key-note").textContent = "key added";
  await refresh();
});

$("chat-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const entry = functions.get($("model").value);
  const text = $("prompt").value.trim();
  if (!entry || !text || streaming) return;
  $("prompt").value = "";
  streaming = true;
  $("send").disabled = true;
  addTurn("user", text);
  history.push({ role: "user", content: text });
  const bubble = addTurn("assistant", "");
  try {
    const reply = await stream(entry, text, bubble);
    history.push({ role: "assistant", content: reply });
  } catch (error) {
    bubble.className = "turn error";
    bubble.textContent = error.message;
    history.pop();
  } finally {
    streaming = false;
    $("send").disabled = false;
    bubble.dataset.done = "true";
  }
});

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("chat-form").requestSubmit();
  }
});

function reset() {
  history = [];
  $("conversation").replaceChildren();
}
$("reset").addEventListener("click", reset);
$("model").addEventListener("change", reset);

saveKeys();
refresh();
setInterval(refresh, POLL_MS);
