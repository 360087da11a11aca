// quicsrv's chat page: a conversation through the Responses API (previous_response_id), each
// answer streamed over fetch and resumed from its last sequence number whenever the stream
// breaks (a network drop, a reload), so no character is lost or repeated.
//
// Model text only ever goes into the page as text (textContent), never as HTML.
"use strict";

const KEY = "quicsrv.apiKey"; // session storage: this tab only
const TURNS = "quicsrv.turns"; // the finished turns of the conversation
const PENDING = "quicsrv.pending"; // the answer being generated: id, last event, text so far
const BACKOFF_MS = [250, 500, 1000, 2000, 4000];

const $ = (id) => document.getElementById(id);

class Fatal extends Error {} // an answer the page cannot resume (a refusal, a takeover)

const page = {
  model: null,
  turns: [],
  current: null, // the turn being answered
  wake: null, // resolves the reconnect wait early (the browser is back online)
  reconnects: 0, // streams resumed after a break, since the page loaded (#status data-reconnects)
};

function headers(json) {
  const result = {};
  const key = sessionStorage.getItem(KEY);
  if (key) result.authorization = "Bearer " + key;
  if (json) result["content-type"] = "application/json";
  return result;
}

function setStatus(status, notice = "", error = false) {
  $("status").textContent = status;
  $("notice").textContent = notice;
  $("notice").className = error ? "error" : "";
  const busy = status === "streaming" || status === "reconnecting";
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// --- the transcript ----------------------------------------------------------------------

function addTurn(turn) {
  const box = document.createElement("div");
  box.className = "turn";
  const user = document.createElement("div");
  user.className = "message user";
  user.textContent = turn.user;
  const assistant = document.createElement("div");
  assistant.className = "message assistant";
  assistant.textContent = turn.text;
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.textContent = turn.stats || "";
  box.append(user, assistant, stats);
  $("transcript").append(box);
  turn.view = { assistant, stats };
  // #output is always the assistant text of the latest turn.
  const previous = $("output");
  if (previous) previous.removeAttribute("id");
  assistant.id = "output";
  box.scrollIntoView({ block: "end" });
}

function saveTurns() {
  const plain = page.turns.map(({ user, text, id, stats }) => ({ user, text, id, stats }));
  sessionStorage.setItem(TURNS, JSON.stringify(plain));
}

function savePending(turn) {
  const { user, text, id, last, temperature, maxTokens } = turn;
  sessionStorage.setItem(
    PENDING,
    JSON.stringify({ user, text, id, last, temperature, maxTokens }),
  );
}

// --- one answer, however many connections it takes ----------------------------------------

async function answer(turn) {
  page.current = turn;
  setStatus("streaming");
  for (let attempt = 0; ; attempt++) {
    try {
      const response = await open(turn);
      $("protocol").textContent = response.headers.get("quicsrv-protocol") || "?";
      turn.protocol = $("protocol").textContent;
      if (await read(turn, response)) break; // the final event arrived
      throw new Error("the stream ended before the answer did");
    } catch (error) {
      if (error instanceof Fatal) {
        finish(turn, error.message);
        return;
      }
      page.reconnects += 1;
      $("status").dataset.reconnects = String(page.reconnects);
      const wait = BACKOFF_MS[Math.min(attempt, BACKOFF_MS.length - 1)];
      setStatus("reconnecting", `connection lost (${error.message}); resuming…`);
      await pause(wait);
      setStatus("streaming");
    }
  }
  finish(turn, "");
}

function open(turn) {
  if (turn.id === null) {
    const body = {
      model: page.model,
      input: turn.user,
      stream: true,
      temperature: turn.temperature,
      max_output_tokens: turn.maxTokens,
    };
    const previous = page.turns.length ? page.turns[page.turns.length - 1].id : null;
    if (previous) body.previous_response_id = previous;
    return checked(fetch("/v1/responses", {
      method: "POST", headers: headers(true), body: JSON.stringify(body),
    }), true);
  }
  const url = `/v1/responses/${turn.id}?stream=true&starting_after=${turn.last}`;
  return checked(fetch(url, { headers: headers(false) }), false);
}

async function checked(pending, creating) {
  const response = await pending;
  if (response.ok) return response;
  let message = `HTTP ${response.status}`;
  try {
    const body = await response.json();
    message = body.error.message || message;
  } catch (ignored) { /* not JSON */ }
  // Worth trying again: the server restarting or busy. Anything else is final.
  if (response.status >= 500 || response.status === 429 || response.status === 408) {
    throw new Error(message);
  }
  if (creating && response.status === 401) $("key-row").hidden = false;
  throw new Fatal(message);
}

// Reads SSE events until the final one (true) or until the stream ends without it (false).
async function read(turn, response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return false;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6));
      if (data.length && apply(turn, JSON.parse(data.join("\n")))) return true;
    }
  }
}

// One event; true when it ends the answer.
function apply(turn, event) {
  if (event.type === "error") {
    if (event.code === "superseded") throw new Fatal("another tab or client took this answer over");
    throw new Error(event.message || event.code); // resumable: the server says what to wait for
  }
  if (event.sequence_number <= turn.last) return false; // had it before the reconnect
  turn.last = event.sequence_number;
  if (event.type === "response.created") {
    turn.id = event.response.id;
  } else if (event.type === "response.output_text.delta") {
    if (event.delta && turn.firstAt === null) turn.firstAt = performance.now();
    turn.text += event.delta;
    turn.view.assistant.textContent = turn.text;
  } else if (event.type === "response.completed" || event.type === "response.incomplete") {
    turn.usage = event.response.usage;
    turn.outcome = event.response.status;
    savePending(turn);
    return true;
  }
  savePending(turn);
  return false;
}

function finish(turn, problem) {
  sessionStorage.removeItem(PENDING);
  page.current = null;
  if (problem) {
    turn.stats = `not finished: ${problem}`;
    turn.view.stats.textContent = turn.stats;
    setStatus("error", problem, true);
    return;
  }
  const tokens = turn.usage ? turn.usage.output_tokens : 0;
  const seconds = turn.firstAt === null ? 0 : (performance.now() - turn.firstAt) / 1000;
  const rate = seconds > 0 && tokens > 1 ? ` · ${((tokens - 1) / seconds).toFixed(1)} tokens/s` : "";
  const outcome = turn.outcome === "completed" ? "" : ` · ${turn.outcome}`;
  turn.stats = `${tokens} tokens${rate} · ${turn.protocol}${outcome}`;
  turn.view.stats.textContent = turn.stats;
  page.turns.push(turn);
  saveTurns();
  setStatus("done");
}

function pause(ms) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    page.wake = () => { clearTimeout(timer); resolve(); };
  }).finally(() => { page.wake = null; });
}

// --- what the user does ------------------------------------------------------------------

function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || page.current || !page.model) return;
  $("prompt").value = "";
  const turn = {
    user: text,
    text: "",
    id: null,
    last: -1,
    firstAt: null,
    temperature: Number($("temperature").value),
    maxTokens: Math.max(1, Math.floor(Number($("max-tokens").value))),
  };
  addTurn(turn);
  answer(turn);
}

async function stop() {
  const turn = page.current;
  if (!turn || turn.id === null) return;
  // The server ends it; the stream (now, or once it reconnects) reads the rest and the end.
  await fetch(`/v1/responses/${turn.id}/cancel`, { method: "POST", headers: headers(false) });
}

function newChat() {
  if (page.current) return;
  page.turns = [];
  sessionStorage.removeItem(TURNS);
  $("transcript").replaceChildren();
  setStatus("idle");
}

async function loadModel() {
  const response = await fetch("/v1/models", { headers: headers(false) });
  if (response.status === 401) {
    $("key-row").hidden = false;
    setStatus("idle", "enter the server's API key to start", true);
    return false;
  }
  const body = await response.json();
  page.model = body.data[0].id;
  $("model").textContent = page.model;
  $("key-row").hidden = true;
  return true;
}

async function start() {
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) send(event);
  });
  $("stop").addEventListener("click", stop);
  $("new").addEventListener("click", newChat);
  $("save-key").addEventListener("click", async () => {
    sessionStorage.setItem(KEY, $("api-key").value.trim());
    if (await loadModel()) setStatus("idle");
  });
  window.addEventListener("online", () => { if (page.wake) page.wake(); });
  for (const turn of JSON.parse(sessionStorage.getItem(TURNS) || "[]")) {
    page.turns.push(turn);
    addTurn(turn);
  }
  setStatus("idle");
  if (!(await loadModel())) return;
  // A reload during a generation: find it again and go on from the last event read.
  const pending = JSON.parse(sessionStorage.getItem(PENDING) || "null");
  if (pending) {
    const turn = { ...pending, firstAt: null };
    addTurn(turn);
    if (turn.id === null) {
      finish(turn, "the page was reloaded before the server answered; send it again");
    } else {
      answer(turn);
    }
  }
}

start();
