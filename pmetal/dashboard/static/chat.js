// The dashboard's chat page: talks to `pmetal serve` through this node
// (/api/serve says where it runs, /api/chat streams its answers as
// server-sent events). Plain script, no build step; model text is only ever
// set as text (never as HTML).
"use strict";

const POLL_MS = 2000;
const $ = (id) => document.getElementById(id);

let conversation = [];       // the turns sent with every request
let servers = [];            // /api/serve's servers
let lastStatus = null;       // /api/serve's last answer
let controller = null;       // the answer streaming now (its AbortController)

// ------------------------------------------------------------ serve status

function withCode(element, text) {
  // `code` spans of a message as <code>, the rest as text.
  element.replaceChildren();
  text.split("`").forEach((part, i) => {
    if (i % 2) {
      const code = document.createElement("code");
      code.textContent = part;
      element.append(code);
    } else if (part) {
      element.append(part);
    }
  });
}

function current() {
  const healthy = servers.filter((s) => s.health === "ok");
  const chosen = $("server").value;
  return healthy.find((s) => s.url === chosen) || healthy[0] || null;
}

function showStatus(status) {
  lastStatus = status;
  servers = status.servers || [];
  const healthy = servers.filter((s) => s.health === "ok");
  const select = $("server");
  const wanted = select.value;
  select.replaceChildren(...healthy.map((s) => new Option(`${s.model} at ${s.url}`, s.url)));
  if (healthy.some((s) => s.url === wanted)) select.value = wanted;
  select.hidden = healthy.length < 2;

  const box = $("serve-status");
  const chosen = current();
  box.className = "status " + (chosen ? "ok" : servers.length ? "broken" : "off");
  box.dataset.state = chosen ? "running" : servers.length ? "unreachable" : "not-running";
  withCode(box, chosen ? `pmetal serve answers with ${chosen.model} at ${chosen.url}.`
    : status.message);

  const server = chosen;
  const recent = server && server.stats && server.stats.recent;
  const figures = $("serve-figures");
  if (recent && recent.requests) {
    const rate = recent.tokens_per_second;
    const first = recent.time_to_first_token;
    figures.textContent = `last ${recent.requests} request(s): ` +
      (rate === null ? "" : `${rate.toFixed(1)} tokens/s, `) +
      `first token in ${(first * 1000).toFixed(0)} ms` +
      (server.stats.live ? `; ${server.stats.live} running now` : "");
  } else {
    figures.textContent = server ? "no request yet" : "";
  }
  $("serve-pipeline").textContent = describePipeline(server && server.pipeline);
  updateButtons();
}

function describePipeline(pipeline) {
  // Each stage: its layers, its node, its compute time per decode step.
  if (!pipeline || !pipeline.stages) return "";
  const stages = pipeline.stages.map((s) => {
    const where = `stage ${s.index}: layers ${s.layers[0]}-${s.layers[1] - 1} on ` +
      `${String(s.node).slice(0, 8)}`;
    if (s.failure) return `${where} (failed: ${s.failure})`;
    if (!s.decode_steps) return where;
    return `${where}, ${(1000 * s.decode_seconds / s.decode_steps).toFixed(2)} ms/step`;
  });
  return `pipeline: ${stages.join(" · ")}`;
}

async function poll() {
  try {
    const response = await fetch("/api/serve", {cache: "no-store"});
    if (!response.ok) throw new Error(`${response.status} ${response.statusText}`);
    showStatus(await response.json());
  } catch (exc) {
    servers = [];
    const box = $("serve-status");
    box.className = "status off";
    box.dataset.state = "node-unreachable";
    box.textContent = `This node does not answer (${exc.message}): is it still running?`;
    updateButtons();
  }
  setTimeout(poll, POLL_MS);
}

function updateButtons() {
  const busy = controller !== null;
  $("send").disabled = busy || current() === null;
  $("stop").disabled = !busy;
}

// ------------------------------------------------------------ conversation

function addMessage(role, text) {
  const root = document.createElement("div");
  root.className = `message ${role}`;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  const content = document.createElement("div");
  content.className = "content";
  const node = document.createTextNode(text);
  content.append(node);
  root.append(label, content);
  $("messages").append(root);
  root.scrollIntoView({block: "end"});
  return {root, node};
}

function note(view, className, text) {
  const element = document.createElement("div");
  element.className = className;
  element.textContent = text;
  view.root.append(element);
}

async function errorOf(response) {
  // serve's and the node's errors are OpenAI error objects.
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON: shown as it is */ }
  return `${response.status} ${response.statusText}: ${text.slice(0, 300)}`;
}

function settings() {
  const body = {};
  const temperature = $("temperature").value.trim();
  if (temperature !== "") body.temperature = Number(temperature);
  const maxTokens = $("max-tokens").value.trim();
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  return body;
}

async function ask(text) {
  const server = current();
  const turns = conversation;   // Clear starts another conversation meanwhile
  turns.push({role: "user", content: text});
  addMessage("user", text);
  const view = addMessage("assistant", "");
  view.root.classList.add("streaming");
  view.root.dataset.state = "streaming";
  controller = new AbortController();
  updateButtons();
  const started = performance.now();
  let answer = "";
  let usage = null;
  let error = null;
  let done = false;
  try {
    const response = await fetch("/api/chat", {
      method: "POST", headers: {"Content-Type": "application/json"}, signal: controller.signal,
      body: JSON.stringify({messages: turns, server: server && server.url, ...settings()}),
    });
    if (!response.ok) {
      error = await errorOf(response);
    } else {
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let pending = "";
      while (!done) {
        const {value, done: end} = await reader.read();
        if (end) break;
        pending += decoder.decode(value, {stream: true});
        const events = pending.split("\n\n");
        pending = events.pop();
        for (const event of events) {
          if (!event.startsWith("data: ")) continue;
          const data = event.slice(6);
          if (data === "[DONE]") { done = true; break; }
          const chunk = JSON.parse(data);
          if (chunk.error) { error = chunk.error.message; continue; }
          if (chunk.usage) usage = chunk.usage;
          for (const choice of chunk.choices || []) {
            const piece = choice.delta && choice.delta.content;
            if (piece) {
              view.node.appendData(piece);
              answer += piece;
            }
          }
        }
        view.root.scrollIntoView({block: "end"});
      }
      if (!done && error === null) {
        error = "the answer stopped before its end: this node or pmetal serve went away";
      }
    }
  } catch (exc) {
    if (exc.name !== "AbortError") {
      error = `the request failed (${exc.message}): is this node still running?`;
    }
  }
  const stopped = controller.signal.aborted;
  controller = null;
  view.root.classList.remove("streaming");
  if (stopped) {
    view.root.dataset.state = "stopped";
    note(view, "note", "stopped");
    if (answer) turns.push({role: "assistant", content: answer});
  } else if (error !== null) {
    view.root.dataset.state = "failed";
    view.root.classList.add("failed");
    note(view, "error", error);
    turns.pop();         // the turn that failed is not part of the conversation
  } else {
    view.root.dataset.state = "done";
    turns.push({role: "assistant", content: answer});
    if (usage) {
      const seconds = (performance.now() - started) / 1000;
      note(view, "note", `${usage.completion_tokens} tokens in ${seconds.toFixed(2)} s ` +
        `(${(usage.completion_tokens / seconds).toFixed(1)} tokens/s), ` +
        `prompt ${usage.prompt_tokens} tokens`);
    }
  }
  updateButtons();
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || controller !== null || current() === null) return;
  $("prompt").value = "";
  ask(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && controller) controller.abort();
});
$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  conversation = [];
  $("messages").replaceChildren();
});
$("server").addEventListener("change", () => { if (lastStatus) showStatus(lastStatus); });

poll();
