"""``hs-extract accept``: what a trained drafter gets accepted, measured against a running
EAGLE-3 server on held-out chats.

Each conversation's prompt is every turn before its last assistant turn (the whole
conversation when it has none), rendered with the model's chat template and generation prompt
and sent as token ids (temperature 0 unless --temperature). SGLang reports per request
``completion_tokens``, ``spec_verify_ct`` (verification passes), the correct drafts and their
histogram per pass. Two accept lengths are printed, both sums over exactly these requests:
``accept_length`` = Σ completion_tokens / Σ spec_verify_ct, which counts the first token (it
comes from the prefill pass; SGLang's per-request ``spec_accept_length`` and SpecForge's
bench_eagle3.py count it too), and ``accept_length_gauge`` = 1 + Σ correct drafts / Σ
spec_verify_ct, without it: SGLang's own gauge, ``avg_spec_accept_length`` of /server_info (which
sums every request since the server started). An untrained drafter gives 1 + 1/passes and 1.0.
Acceptance by draft position comes from the per-request histograms; the share of answers that
ran to --max-new-tokens (finish_reason length) is counted. With ``--plain`` (the same target
without speculative decoding; greedy only) every output is compared token by token; where the two
differ, the plain server's log-probabilities at the first difference tell whether it is a
near-tie (the two tokens within ``--tie-margin`` nats: batch-dependent bf16 rounding may flip it)
or a real mismatch (a drafter must never change a greedy output).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
from dataclasses import asdict
from typing import Any, Callable

from hs_patch.host.drafter.accept_report import Conversation, read_answer, summarize

DESCRIPTION = __doc__.split("\n\n", 1)[1] + """
output: the summary (--json: one JSON object) and, with --out FILE, the whole report as JSON, written
atomically: every conversation (tokens, verification passes, correct drafts, their histogram, finish
reason, the output ids' sha256; the ids too with --output-ids), every difference.

exit codes: 0 every conversation measured (and, with --plain, every output compared and every
difference a near-tie); 1 error, a conversation failed (the summary still covers the others),
stopped after --max-consecutive-failures, or with --plain a comparison that could not be made; 3 with --plain, an output differs beyond a near-tie (listed); 130 interrupted (nothing written)
"""

EXIT_OK, EXIT_ERROR, EXIT_MISMATCH, EXIT_INTERRUPTED = 0, 1, 3, 130
SPEC_KEYS = ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
             "speculative_num_draft_tokens", "speculative_draft_model_path")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", required=True, metavar="URL", help="the EAGLE-3 server (SGLang with "
                   "--speculative-algorithm EAGLE3 and the drafter)")
    p.add_argument("--data", required=True, nargs="+", metavar="FILE", help="held-out chats, JSONL (the formats "
                   "hs-extract drive reads; pre-tokenized lines are sent as they are)")
    p.add_argument("--model", "--tokenizer", dest="model", required=True, metavar="DIR",
                   help="the served model's directory (tokenizer and chat template)")
    p.add_argument("--plain", metavar="URL", help="the same target served without speculative decoding: every "
                   "output is compared with its greedy output")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="tokens generated per "
                   "conversation (default: %(default)s; generation also stops at the model's end of turn)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature (default: "
                   "%(default)s, greedy; above 0 the accept length measures sampled decoding, and --plain, a "
                   "greedy check, is refused)")
    p.add_argument("--output-ids", action="store_true", help="keep every output's token ids in --out (their sha256 "
                   "is always kept)")
    p.add_argument("--limit", type=int, default=0, metavar="N", help="only the first N conversations (0: all)")
    p.add_argument("--concurrency", type=int, default=16, metavar="N", help="requests in flight (default: "
                   "%(default)s; SGLang batches them as it would in production)")
    p.add_argument("--tie-margin", type=float, default=0.25, metavar="NATS", help="a difference is a near-tie when "
                   "the plain server's log-probabilities of the two tokens differ by at most this (default: "
                   "%(default)s: two bf16 units of a logit between 16 and 32; seen on the H200: every "
                   "difference within 0.125)")
    p.add_argument("--api-key-file", metavar="FILE", help="the servers' API key (else $SGLANG_API_KEY)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the tokenizer's own code (Kimi)")
    p.add_argument("--chat-template-kwargs", default="{}", metavar="JSON", help="extra chat template variables")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per request (default: %(default)s)")
    p.add_argument("--max-consecutive-failures", type=int, default=5, metavar="N", help="stop sending after N "
                   "conversations in a row found a server unreachable, each after its retries (about a minute): "
                   "the rest fail as not sent (0: never stop; default: %(default)s)")
    p.add_argument("--out", metavar="FILE", help="write the whole report here (JSON)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def prompts(paths: list[str], tokenizer: Any, template_kwargs: dict[str, Any], limit: int
            ) -> tuple[list[tuple[str, list[int]]], list[dict[str, Any]]]:
    """(sample id, prompt token ids) per usable line, and the rejected lines."""
    from hs_patch.host.driver import chat, dataset

    out, rejects = [], []
    for item in dataset.read(paths, prompts_only=True):
        if limit and len(out) >= limit:
            break
        if isinstance(item, dataset.Reject):
            rejects.append(item.as_dict())
            continue
        try:
            if item.input_ids is not None:
                ids = list(item.input_ids)
            else:
                msgs = item.messages or []
                last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=len(msgs))
                if last == 0:
                    raise dataset.Invalid("assistant_first", "no turn before the assistant's: nothing to prompt with")
                text = chat.render(tokenizer, msgs[:last], generation_prompt=True, template_kwargs=template_kwargs)
                ids = chat.encode_text(tokenizer, text)
        except dataset.Invalid as e:
            rejects.append(dataset.Reject(item.source, item.line, e.reason, str(e)).as_dict())
            continue
        out.append((item.sample_id, ids))
    return out, rejects


def spec_settings(info: dict[str, Any]) -> dict[str, Any]:
    return {k: info.get(k) for k in SPEC_KEYS}


def measure_one(client: Any, sid: str, ids: list[int], params: dict[str, Any], k: int) -> Conversation:
    from hs_patch.host.driver.client import ClientError, ServerRejected

    c = Conversation(sid, len(ids))
    try:
        out = client.generate(ids, params, f"accept-{os.getpid()}-{k}")
    except ClientError as e:
        c.error, c.unreachable = str(e), not isinstance(e, ServerRejected)
        return c
    read_answer(c, out)
    return c


def compare(plain: Any, c: Conversation, ids: list[int], params: dict[str, Any], tie_margin: float, k: int) -> None:
    """Fill ``c.greedy``: identical, or the first difference and whether it is a near-tie."""
    from hs_patch.host.driver.client import ClientError

    try:
        ref = [int(t) for t in plain.generate(ids, params, f"accept-plain-{os.getpid()}-{k}").get("output_ids") or []]
        n = min(len(ref), len(c.output_ids))
        at = next((i for i in range(n) if ref[i] != c.output_ids[i]), None)
        if at is None and len(ref) == len(c.output_ids):
            c.greedy = {"identical": True}
            return
        if at is None:  # one stopped earlier (an end of turn the other did not emit at the same place)
            c.greedy = {"identical": False, "at": n, "spec_len": len(c.output_ids), "plain_len": len(ref),
                        "near_tie": False, "why": "lengths differ with a common prefix"}
            return
        prefix = ids + c.output_ids[:at]
        probe = plain.generate(prefix, {"max_new_tokens": 1, "temperature": 0.0}, f"accept-tie-{os.getpid()}-{k}",
                               return_logprob=True, logprob_start_len=len(prefix) - 1, top_logprobs_num=20)
        top = {int(e[1]): float(e[0]) for e in (probe["meta_info"].get("output_top_logprobs") or [[]])[0] if e}
        spec_tok, plain_tok = c.output_ids[at], ref[at]
        margin = None if spec_tok not in top or plain_tok not in top else round(top[plain_tok] - top[spec_tok], 5)
        c.greedy = {"identical": False, "at": at, "spec_token": spec_tok, "plain_token": plain_tok,
                    "margin_nats": margin, "near_tie": margin is not None and margin <= tie_margin}
    except ClientError as e:
        c.greedy = {"error": str(e)}


def run(a: argparse.Namespace, progress: Callable[[int, int], None] = lambda done, total: None) -> dict[str, Any]:
    from hs_patch.host.driver.chat import load_tokenizer
    from hs_patch.host.driver.client import SGLangClient, read_api_key

    kwargs = json.loads(a.chat_template_kwargs)
    key = read_api_key(a.api_key_file)
    stop, why = threading.Event(), []
    spec = SGLangClient(a.server, timeout=a.timeout, api_key=key, should_stop=stop.is_set)
    spec_info = spec.server_info(timeout=30)
    settings = spec_settings(spec_info)
    if str(settings["speculative_algorithm"] or "").upper() not in ("EAGLE3", "EAGLE"):
        raise ValueError(f"{spec.display_url} does not run EAGLE-3 (speculative_algorithm "
                         f"{settings['speculative_algorithm']!r}): start it with --speculative-algorithm EAGLE3 "
                         "--speculative-draft-model-path DRAFTER")
    plain = SGLangClient(a.plain, timeout=a.timeout, api_key=key, should_stop=stop.is_set) if a.plain else None
    plain_info = plain.server_info(timeout=30) if plain is not None else {}
    if plain_info.get("speculative_algorithm"):
        raise ValueError(f"--plain {plain.display_url} runs speculative decoding itself: give a server of the same "
                         "target without --speculative-algorithm")
    models = (spec_info.get("model_path"), plain_info.get("model_path"))
    if all(models) and models[0] != models[1]:  # the same weights may sit at two paths: said, not refused
        print(f"hs-extract accept: warning: --plain serves {models[1]}, the EAGLE-3 server {models[0]}: unless "
              "these are the same weights, the greedy differences are the models', not the drafter's",
              file=sys.stderr)
    work, rejects = prompts(a.data, load_tokenizer(a.model, a.trust_remote_code), kwargs, a.limit)
    if not work:
        raise ValueError(f"no usable conversation in {', '.join(a.data)} ({len(rejects)} rejected lines)")
    params = {"max_new_tokens": a.max_new_tokens, "temperature": a.temperature, "ignore_eos": a.ignore_eos}
    t0 = time.time()
    lock, in_a_row = threading.Lock(), [0]

    def one(k: int) -> Conversation:
        sid, ids = work[k]
        if stop.is_set():
            return Conversation(sid, len(ids), error=f"not sent: {why[0]}")
        c = measure_one(spec, sid, ids, params, k)
        with lock:
            in_a_row[0] = in_a_row[0] + 1 if c.unreachable else 0
            if a.max_consecutive_failures and in_a_row[0] >= a.max_consecutive_failures and not stop.is_set():
                why.append(f"{in_a_row[0]} conversations in a row found {spec.display_url} unreachable, the last: "
                           f"{c.error}")
                stop.set()
        if plain is not None and not c.error:
            compare(plain, c, ids, params, a.tie_margin, k)
        return c

    convs = _map(one, len(work), a.concurrency, progress)
    summary = summarize(convs, settings, rejects, plain is not None, time.time() - t0)
    if why:
        summary["stopped"] = why[0]
    dropped = ("unreachable",) if a.output_ids else ("output_ids", "unreachable")
    report = {**summary, "server": spec.display_url, "plain": plain.display_url if plain else None,
              "max_new_tokens": a.max_new_tokens, "temperature": a.temperature, "tie_margin": a.tie_margin,
              "by_conversation": [{k: v for k, v in asdict(c).items() if k not in dropped} for c in convs],
              "rejects": rejects}
    if a.out:
        from hs_patch.samples.files import write_text_atomic

        write_text_atomic(a.out, json.dumps(report, indent=1) + "\n", fsync=True, mode=0o600)
    return summary


def _map(fn: Callable[[int], Conversation], total: int, concurrency: int,
         progress: Callable[[int, int], None]) -> list[Conversation]:
    """``fn(k)`` for k in 0..total-1, ``concurrency`` at a time, in order. Daemon threads: Ctrl-C
    returns at once instead of waiting up to --timeout for the requests in flight."""
    results: list[Any] = [None] * total
    finished: queue.Queue[int] = queue.Queue()
    todo, lock = iter(range(total)), threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                k = next(todo, None)
            if k is None:
                return
            try:
                results[k] = fn(k)
            except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
                results[k] = e
            finished.put(k)

    for _ in range(min(max(1, concurrency), total)):
        threading.Thread(target=worker, daemon=True, name="accept").start()
    for done in range(1, total + 1):
        k = finished.get()
        if isinstance(results[k], BaseException):
            raise results[k]
        progress(done, total)
    return results


def run_args(a: argparse.Namespace) -> int:
    from hs_patch.host.driver.client import ClientError
    from hs_patch.host.driver.datafile import DataFileError

    if a.max_new_tokens < 1 or a.concurrency < 1 or a.limit < 0 or a.max_consecutive_failures < 0 or a.temperature < 0:
        print("hs-extract accept: --max-new-tokens and --concurrency must be >= 1, --limit, "
              "--max-consecutive-failures and --temperature >= 0", file=sys.stderr)
        return EXIT_ERROR
    if a.plain and a.temperature > 0:
        print("hs-extract accept: --plain compares greedy outputs: it needs --temperature 0", file=sys.stderr)
        return EXIT_ERROR
    try:
        json.loads(a.chat_template_kwargs)
    except ValueError:
        print(f"hs-extract accept: --chat-template-kwargs {a.chat_template_kwargs!r} is not JSON", file=sys.stderr)
        return EXIT_ERROR
    if a.out and not os.access(os.path.dirname(os.path.abspath(a.out)), os.W_OK):   # before the hours of measuring
        print(f"hs-extract accept: --out {a.out}: its directory {os.path.dirname(os.path.abspath(a.out))} does not "
              "exist or is not writable", file=sys.stderr)
        return EXIT_ERROR
    bar = _Bar(not a.json and sys.stderr.isatty())
    try:
        with bar:
            s = run(a, bar.update)
    except (ClientError, DataFileError, ValueError, OSError) as e:
        print(f"hs-extract accept: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("hs-extract accept: interrupted; nothing written (run it again)", file=sys.stderr)
        return EXIT_INTERRUPTED
    if a.json:
        print(json.dumps(s, sort_keys=True))
    else:
        _print_summary(s, a.max_new_tokens)
        if "greedy" in s:
            g = s["greedy"]
            print(f"greedy: {g['identical']}/{g['compared']} identical to the plain server, {g['near_tie']} "
                  f"near-ties, {g['mismatch']} mismatches, {g['errors']} not compared"
                  + (f" (see {a.out})" if a.out and (g["mismatch"] or g["errors"]) else ""))
    return _verdict(s)


def _print_summary(s: dict[str, Any], cap: int) -> None:
    st = s["server_settings"]
    print(f"accept length {s['accept_length']} over {s['measured']} conversations "
          f"({s['completion_tokens']} tokens in {s['verify_ct']} verify passes, the prefill's first token counted, "
          f"as SGLang's per-request spec_accept_length and SpecForge's bench_eagle3) at steps "
          f"{st['speculative_num_steps']}, topk {st['speculative_eagle_topk']}, draft tokens "
          f"{st['speculative_num_draft_tokens']}; {s['failed']} failed, {s['rejected_lines']} lines rejected")
    gauge = s.get("accept_length_gauge")
    print(f"accept length without the prefill's token (SGLang's gauge avg_spec_accept_length: 1 + correct drafts / "
          f"verify passes): {gauge if gauge is not None else 'not reported by this server (no correct-draft count)'}")
    pos = s.get("by_position")
    if pos:
        print("accepted at draft position 1..: " + " ".join(f"{x:.3f}" for x in pos["accepted_at"])
              + " (share of verify passes; given the previous: "
              + " ".join("-" if x is None else f"{x:.3f}" for x in pos["accepted_given_previous"]) + ")")
    else:
        print("acceptance by draft position: no per-request histogram from this server")
    if s["measured"]:
        print(f"answers at the --max-new-tokens cap ({cap}): {s['at_cap']}/{s['measured']}")


def _verdict(s: dict[str, Any]) -> int:
    """The exit code, saying on stderr why a run proves nothing (or not everything)."""
    g = s.get("greedy", {})
    if s.get("stopped"):
        print(f"hs-extract accept: stopped: {s['stopped']}; is the server up? Run it again when it is",
              file=sys.stderr)
        return EXIT_ERROR
    if s["accept_length"] is None:
        why = (f"every conversation failed, e.g. {s.get('first_error')}" if s["measured"] == 0 else
               "no answer had a verify pass (raise --max-new-tokens: the first token comes from the prefill)")
        print(f"hs-extract accept: nothing measured: {why}", file=sys.stderr)
        return EXIT_ERROR
    if g.get("mismatch"):
        return EXIT_MISMATCH
    if s["failed"]:  # a number over fewer conversations than asked for is not the measurement asked for
        print(f"hs-extract accept: incomplete: {s['failed']} of {s['failed'] + s['measured']} conversations failed, "
              f"e.g. {s.get('first_error')}; the accept length covers the {s['measured']} measured (--out lists "
              "each); run it again when the cause is fixed", file=sys.stderr)
        return EXIT_ERROR
    if g.get("errors"):
        print(f"hs-extract accept: the greedy check is incomplete: {g['errors']} of {g['errors'] + g['compared']} "
              f"outputs could not be compared with --plain, e.g. {g.get('first_error')}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


class _Bar:
    """A rich progress bar on a terminal (conversations, rate, ETA); nothing otherwise."""

    def __init__(self, enabled: bool):
        self.enabled, self.progress, self.task = enabled, None, None

    def __enter__(self) -> "_Bar":
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("accept"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                     transient=True)
            self.progress.__enter__()
        return self

    def update(self, done: int, total: int) -> None:
        if self.progress is not None:
            if self.task is None:
                self.task = self.progress.add_task("accept", total=total)
            self.progress.update(self.task, completed=done)

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)
