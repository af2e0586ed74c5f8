// deskvm pages: sign-in by cookie (never a token in a URL), fetch helpers, formatting.
"use strict";

const deskvm = (() => {
  const $ = (id) => document.getElementById(id);

  class HttpError extends Error {
    constructor(status, code, message) { super(message); this.status = status; this.code = code; }
  }

  // Every request rides on the page's HttpOnly sign-in cookie; writes carry the
  // anti-forgery header the server asks of cookie-authenticated requests.
  async function api(path, options = {}) {
    const opts = Object.assign({ credentials: "same-origin" }, options);
    opts.headers = Object.assign({}, options.headers || {});
    const method = (opts.method || "GET").toUpperCase();
    if (method !== "GET" && method !== "HEAD") opts.headers["X-Requested-With"] = "deskvm";
    if (opts.json !== undefined) {
      opts.body = JSON.stringify(opts.json);
      opts.headers["Content-Type"] = "application/json";
      delete opts.json;
    }
    const response = await fetch(path, opts);
    if (!response.ok) {
      let code = "http_error", message = `${method} ${path}: HTTP ${response.status}`;
      try {
        const body = await response.json();
        code = body.error.code; message = body.error.message;
      } catch (_) { /* not JSON */ }
      throw new HttpError(response.status, code, message);
    }
    return response;
  }

  // Sign in to `target` ("server" or a session id). A token may arrive in the URL
  // fragment (#token=..., never sent to the server by the browser): it is removed from the
  // address bar at once and exchanged for a short HttpOnly cookie. Without one, an existing
  // cookie is used, or the person is asked for a token.
  async function signIn(target, { allowServer = false } = {}) {
    const cookiePath = target === "server" ? "/v1/cookie" : `/v1/sessions/${target}/cookie`;
    const fragment = new URLSearchParams(location.hash.slice(1));
    const token = fragment.get("token");
    if (token !== null) {
      fragment.delete("token");
      const rest = fragment.toString();
      history.replaceState(null, "", location.pathname + location.search + (rest ? "#" + rest : ""));
      try { return await exchange(token); } catch (err) { return ask(err.message); }
    }
    for (const path of allowServer && target !== "server" ? [cookiePath, "/v1/cookie"] : [cookiePath]) {
      try {
        const who = await (await api(path)).json();
        scheduleRenewal(path, who);
        return who;
      } catch (err) { if (err.status !== 401 && err.status !== 404) throw err; }
    }
    return ask("");

    async function exchange(value) {
      const path = allowServer && target !== "server" && !value.startsWith("dvt1.") ? "/v1/cookie" : cookiePath;
      const who = await (await api(path, { method: "POST", headers: { Authorization: "Bearer " + value } })).json();
      scheduleRenewal(path, who);
      return who;
    }

    function ask(message) {
      return new Promise((resolve) => {
        const box = document.createElement("div");
        box.className = "signin";
        box.innerHTML = `<form autocomplete="off">
            <h1>Sign in</h1>
            <div class="muted">Paste a deskvm token: the server's token, or a session token
              (view, control or admin). It is sent once and exchanged for a short-lived
              cookie; it never goes into a URL.</div>
            <input id="signin-token" type="password" placeholder="token" autofocus>
            <div class="error" id="signin-error"></div>
            <button class="primary" type="submit">Sign in</button></form>`;
        document.body.appendChild(box);
        $("signin-error").textContent = message || "";
        box.querySelector("form").onsubmit = async (e) => {
          e.preventDefault();
          try {
            const who = await exchange($("signin-token").value.trim());
            box.remove();
            resolve(who);
          } catch (err) { $("signin-error").textContent = err.message; }
        };
      });
    }
  }

  function scheduleRenewal(path, who) {
    const left = new Date(who.expires_at).getTime() - Date.now();
    const delay = Math.max(10_000, left / 2);
    setTimeout(async () => {
      try { scheduleRenewal(path, await (await api(path, { method: "POST" })).json()); }
      catch (err) { toast("sign-in expired: reload the page to sign in again", true); }
    }, delay);
  }

  function toast(message, error = false) {
    const el = document.createElement("div");
    el.className = "toast" + (error ? " error" : "");
    el.textContent = message;
    document.body.appendChild(el);
    setTimeout(() => el.remove(), 6000);
  }

  function duration(seconds) {
    if (seconds === null || seconds === undefined || !isFinite(seconds)) return "–";
    const s = Math.max(0, Math.round(seconds));
    if (s < 60) return `${s} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${String(s % 60).padStart(2, "0")} s`;
    return `${Math.floor(s / 3600)} h ${String(Math.floor(s / 60) % 60).padStart(2, "0")} min`;
  }

  function when(iso) {
    if (!iso) return "–";
    const d = new Date(iso), ago = (Date.now() - d.getTime()) / 1000;
    if (ago < 60) return "just now";
    if (ago < 3600) return `${Math.floor(ago / 60)} min ago`;
    if (ago < 86400) return `${Math.floor(ago / 3600)} h ago`;
    return d.toLocaleString();
  }

  function badge(text, cls) {
    const b = document.createElement("span");
    b.className = "badge " + (cls || text);
    b.textContent = text;
    return b;
  }

  function el(tag, props = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props)) {
      if (k === "class") node.className = v;
      else if (k === "dataset") Object.assign(node.dataset, v);
      else if (k.startsWith("on")) node[k] = v;
      else node.setAttribute(k, v);
    }
    for (const c of children) if (c !== null && c !== undefined) node.append(c);
    return node;
  }

  function wsUrl(path) {
    return (location.protocol === "https:" ? "wss://" : "ws://") + location.host + path;
  }

  return { $, api, signIn, toast, duration, when, badge, el, wsUrl, HttpError };
})();
