"""``hs-extract drive``: the subcommand's options, its settings, and the run with its signals.

``DESCRIPTION`` is the subcommand's help; ``add_arguments`` its options (defaults from
:mod:`hs_patch.host.driver.config`); ``drive_config`` turns them into a ``DriveConfig``, refusing
bad values with what to give instead; ``run_args`` runs the :class:`~hs_patch.host.driver.run.Driver`,
turning SIGINT/SIGTERM into a clean stop.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
from typing import Any

DESCRIPTION = """\
Feed a dataset through the local capturing SGLang server (HS_CAPTURE=1) and collect one
final sample per conversation: the hidden states the server captured plus the loss mask
(1 on assistant tokens) and provenance (sample id, source file, line, run).

input (--data, JSONL, formats detected per line, may be mixed):
  {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}   OpenAI
  {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", ...}]}     ShareGPT
  {"input_ids": [1, 2, ...], "loss_mask": [0, 1, ...]}   pre-tokenized (mask optional: all 1)
  Chats are rendered with the model's own chat template and tokenizer (--model) and sent
  as input_ids to /generate (prefill only, max_new_tokens 1), so the server sees exactly
  those tokens. A line that cannot become a sample (not UTF-8, bad JSON, wrong fields,
  empty, no assistant turn, too long with --on-too-long skip, ...) goes to rejects.jsonl
  with its file, line number and reason; it never stops the run.

where files go:
  --samples-dir   final samples <key>.safetensors + manifest.jsonl (what the shipper ships)
  --state-dir     run.json (parameters), ledger.jsonl (every decision), rejects.jsonl,
                  status.json (progress; --prometheus for a textfile too), lock
  --capture-dir   the server's HS_CAPTURE_DIR: the driver leaves each sample's intent (loss
                  mask, provenance) there, the server writes the sample with it, and the
                  driver moves it into --samples-dir (same filesystem)

resume: run the same command again. Samples whose final file matches its manifest entry
(size + sha256), or that the shipper recorded as verified (<state-dir>/shipped.jsonl),
are skipped; everything else is redone; truncated or damaged files are discarded first.
The dataset may have changed (lines appended, removed, changed): each sample records the
sha256 of its line, so the samples of the lines still there are kept wherever they moved,
new lines are extracted, and samples whose line is gone are listed in vanished.jsonl
(kept, not deleted). A restart with different parameters (model, limits, template
kwargs, regeneration, shard) is refused.

before the first sample, one probe of the driver's own checks that the server captures its
requests into --capture-dir (else the run is refused saying what to set).

exit codes: 0 every sample done or rejected; 1 refused, error, or nothing extracted from a
non-empty input (the reasons are in rejects.jsonl);
3 incomplete (failed or unsent samples: run again to resume); 4 stopped after
--max-consecutive-failures; 130 stopped by SIGINT/SIGTERM (a second one kills at once)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``drive`` subcommand's options (defaults from ``DriveConfig``, shown by --help)."""
    from hs_patch.host.driver.config import DEFAULTS as D

    g = p.add_argument_group("what to run")
    g.add_argument("--run", required=True, metavar="NAME", help="run name: names the state and samples dirs; "
                   "reuse it to resume")
    g.add_argument("--data", required=True, nargs="+", metavar="FILE", help="JSONL dataset file(s); sample ids "
                   "are <file name>:<line>, so file names must differ")
    g.add_argument("--model", "--tokenizer", dest="model", required=True, metavar="DIR",
                   help="the served model's directory (its tokenizer and chat template are used)")
    g.add_argument("--trust-remote-code", action="store_true", help="allow the tokenizer's own code "
                   "(needed for Kimi-K2/K2.5's tiktoken tokenizer)")
    g.add_argument("--chat-template-kwargs", default="{}", metavar="JSON", help="extra variables for the chat "
                   "template, e.g. '{\"thinking\": false}' (default: %(default)s)")
    g.add_argument("--limit", type=int, default=D["limit"], metavar="N", help="only the first N input lines (0: all; "
                   "default: %(default)s)")
    g.add_argument("--shard", default=D["shard"], metavar="I/N", help="only shard I of N: the samples whose "
                   "sha256(sample id) %% N is I, so N hosts with 0/N..N-1/N share a dataset, each sample on exactly "
                   "one; adding lines never moves a sample to another shard (fab extract --hosts gives each host "
                   "its own; default: all samples)")
    g.add_argument("--accept-changed-data", action="store_true", help="resume over a changed dataset that is refused "
                   "without this: lines whose samples this shard holds now in other shards (lines inserted or removed "
                   "before them), or none of the run's samples' lines left (another file?). Appended, removed and "
                   "changed lines need nothing: the samples of lines still there are kept, new lines extracted, "
                   "vanished ones listed in vanished.jsonl")
    g = p.add_argument_group("where")
    g.add_argument("--server", default=D["server"], metavar="URL", help="SGLang server "
                   "(default: %(default)s)")
    g.add_argument("--api-key-file", default=D["api_key_file"], metavar="FILE", help="file holding the server's "
                   "API key (SGLang --api-key; the services role writes it); default: $SGLANG_API_KEY, else none")
    g.add_argument("--capture-dir", default=D["capture_dir"], metavar="DIR",
                   help="the server's HS_CAPTURE_DIR, must be the same (default: %(default)s)")
    g.add_argument("--state-dir", default=D["state_dir"], metavar="DIR", help="run state (default: /var/lib/hs-patch/runs/NAME)")
    g.add_argument("--samples-dir", default=D["samples_dir"], metavar="DIR", help="final samples (default: "
                   "/dev/shm/hs-runs/NAME/samples)")
    g.add_argument("--queue", action="store_true", help="while another run holds --capture-dir (one server, one "
                   "driver at a time), wait for it with state queued instead of refusing (fab extract --hosts and "
                   "--reassign queue a host's jobs)")
    g.add_argument("--host-name", default=D["host_name"], metavar="NAME", help="this GPU host's name, written with "
                   "the shard in every sample's metadata and manifest line (fab gives the inventory name; default: "
                   "the system's host name)")
    g = p.add_argument_group("length")
    g.add_argument("--max-tokens", type=int, default=D["max_tokens"], metavar="N", help="longest sample in tokens "
                   "(default: %(default)s)")
    g.add_argument("--on-too-long", choices=("skip", "truncate"), default=D["on_too_long"],
                   help="a longer sample is rejected (skip) or cut to --max-tokens (truncate); the server's own "
                   "limit (/server_info max_req_input_len) applies when smaller (default: %(default)s)")
    g.add_argument("--max-line-chars", type=int, default=D["max_line_chars"], metavar="N",
                   help="a longer input line is rejected as too_long without being read whole (0: 256 x "
                   "--max-tokens, at least 1Mi) (default: %(default)s)")
    g = p.add_argument_group("regeneration (the target model writes the assistant turns first)")
    g.add_argument("--regenerate", action="store_true", help="generate each assistant turn with the served model "
                   "(normal decoding, rid nocap-..., not captured), then capture the conversation as the server's own "
                   "token ids (prompts as sent, answers as generated, </think> included; a turn whose prompt renders "
                   "an earlier answer otherwise leaves that answer out: docs/driver.md); pre-tokenized lines are "
                   "used as they are")
    g.add_argument("--regen-max-new-tokens", type=int, default=D["regen_max_new_tokens"], metavar="N", help="longest generated turn "
                   "(default: %(default)s)")
    g.add_argument("--regen-temperature", type=float, default=D["regen_temperature"], metavar="T", help="sampling temperature of the "
                   "generated turns; 0 is greedy. Use the one you serve with: the drafter learns the distribution "
                   "it is trained on (Moonshot gives Kimi-K2.5 1.0 in thinking mode, 0.6 in instant mode) "
                   "(default: %(default)s)")
    g.add_argument("--regen-top-p", type=float, default=D["regen_top_p"], metavar="P", help="nucleus sampling of the generated "
                   "turns (default: %(default)s)")
    g = p.add_argument_group("requests and failures")
    g.add_argument("--concurrency", type=int, default=D["concurrency"], metavar="N", help="requests at the server at "
                   "once (default: %(default)s)")
    g.add_argument("--awaiting", type=int, default=D["awaiting"], metavar="N", help="samples the server has answered "
                   "whose file the driver may still be waiting for, checking or adopting while the next --concurrency "
                   "requests are at the server: the server's writer runs behind its forward passes, and a request "
                   "that kept its place until its sample was written would leave the server idle; 0: each request "
                   "waits for its sample before the next is sent (default: %(default)s)")
    g.add_argument("--retries", type=int, default=D["retries"], metavar="N", help="retries of a request on connection "
                   "errors, timeouts, 5xx and 429, with exponential backoff and jitter (default: %(default)s)")
    g.add_argument("--backoff", type=float, default=D["backoff"], metavar="S", help="first retry delay; doubles each "
                   "retry (default: %(default)s)")
    g.add_argument("--backoff-max", type=float, default=D["backoff_max"], metavar="S", help="longest retry delay "
                   "(default: %(default)s)")
    g.add_argument("--request-timeout", type=float, default=D["request_timeout"], metavar="S", help="longest wait for one "
                   "/generate answer; then it is retried (default: %(default)s)")
    g.add_argument("--raw-timeout", type=float, default=D["raw_timeout"], metavar="S", help="how long to wait, after the "
                   "server answered, for its raw sample in --capture-dir (default: %(default)s)")
    g.add_argument("--max-consecutive-failures", type=int, default=D["max_consecutive_failures"], metavar="N", help="stop cleanly after N "
                   "samples failed in a row (default: %(default)s)")
    g.add_argument("--server-wait", type=float, default=D["server_wait"], metavar="S", help="wait this long at start for "
                   "/health (default: %(default)s)")
    g = p.add_argument_group("fidelity check (every sample, before it is kept)")
    g.add_argument("--no-fidelity-check", dest="fidelity_check", action="store_false",
                   help="do not check the dumped states (by default every plane of every sample is checked: every "
                        "row's bytes against the exact checksums the hook took on the GPU, every row against the "
                        "embedding of its token and the additive relation of each captured layer, rows of every "
                        "chunk against the model's norm weights (layer identity, full reduction, the final norm), "
                        "the server's logit gaps at the last --fidelity-gap-positions positions, and argmax of the "
                        "model's lm_head over the final state at its last position against the token the server "
                        "generated in that pass; docs/verification.md)")
    g.add_argument("--fidelity-rows", type=int, default=D["fidelity_rows"], metavar="N",
                   help="rows of every chunk of a sample read and checked against the fingerprints and the "
                        "norm weights: its first, its last and N-2 drawn by key (default: %(default)s)")
    g.add_argument("--fidelity-fraction", type=float, default=D["fidelity_fraction"], metavar="F",
                   help="share of samples (chosen by key) also checked at their last --fidelity-positions positions "
                        "against the server's own top-1 of the same pass (return_logprob) (default: %(default)s)")
    g.add_argument("--fidelity-positions", type=int, default=D["fidelity_positions"], metavar="N",
                   help="positions checked per sampled sample (default: %(default)s)")
    g.add_argument("--fidelity-gap-positions", type=int, default=D["fidelity_gap_positions"], metavar="N",
                   help="last positions of EVERY sample where the server's two best logits' gap (return_logprob) "
                        "must equal ours from the stored final state: ties each sample to its own request however "
                        "its template ends it; 0: off (default: %(default)s)")
    g.add_argument("--fidelity-tie-tolerance", type=float, default=D["fidelity_tie_tolerance"], metavar="STD",
                   help="a disagreement whose logit margin is below this many standard deviations of the row's "
                        "logits is a near-tie, not a mismatch (measured on an H200: all same-pass disagreements "
                        "were below 0.013) (default: %(default)s)")
    g.add_argument("--fidelity-max-consecutive", type=int, default=D["fidelity_max_consecutive"], metavar="K",
                   help="stop the run after K mismatching samples in a row, saying what is likely wrong "
                        "(default: %(default)s)")
    g.add_argument("--accept-weaker-check", action="store_true",
                   help="resume a run under a weaker fidelity check than it used (off, fewer rows or positions, a "
                        "smaller fraction, a looser tolerance): refused without this; each sample records how it "
                        "was checked (its header's fidelity_check, its manifest line's fidelity)")
    g = p.add_argument_group("back-pressure and progress")
    g.add_argument("--high-water", type=float, default=D["high_water"], metavar="PCT", help="pause sending when the "
                   "filesystem of --capture-dir or --samples-dir is this full (default: %(default)s)")
    g.add_argument("--low-water", type=float, default=D["low_water"], metavar="PCT", help="resume below this "
                   "(default: %(default)s)")
    g.add_argument("--status-interval", type=float, default=D["status_interval"], metavar="S", help="status.json refresh "
                   "(default: %(default)s)")
    g.add_argument("--prometheus", default=D["prometheus"], metavar="FILE", help="also write the status as a Prometheus "
                   "textfile (node_exporter textfile collector)")


def drive_config(a: argparse.Namespace) -> Any:
    from dataclasses import fields

    from hs_patch.host.driver.config import DriveConfig

    try:
        kwargs = json.loads(a.chat_template_kwargs)
    except ValueError as e:
        raise SystemExit(f"--chat-template-kwargs is not JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise SystemExit("--chat-template-kwargs must be a JSON object")
    for name in ("concurrency", "max_tokens", "max_consecutive_failures", "fidelity_rows"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= a.fidelity_fraction <= 1:  # also nan: it would sample no key, and compare as no weaker
        raise SystemExit("--fidelity-fraction must be a share between 0 and 1")
    if not 0 <= a.fidelity_tie_tolerance < math.inf:
        raise SystemExit("--fidelity-tie-tolerance must be a finite number of standard deviations >= 0")
    if a.fidelity_positions < 1:
        raise SystemExit("--fidelity-positions must be >= 1")
    if not 0 <= a.fidelity_gap_positions < a.fidelity_positions:
        raise SystemExit("--fidelity-gap-positions must be >= 0 (0: off) and below --fidelity-positions (the sampled "
                         "samples are asked for more positions than every sample)")
    if a.awaiting < 0:
        raise SystemExit("--awaiting must be >= 0")
    if a.limit < 0:  # itertools.islice refused it with a ValueError once the run had started
        raise SystemExit("--limit must be >= 0 (0: every line)")
    if a.max_line_chars < 0:
        raise SystemExit("--max-line-chars must be >= 0 (0: the default bound)")
    from hs_patch.names import RunNameError, check_run_name

    try:
        check_run_name(a.run)
    except RunNameError as e:
        raise SystemExit(f"--run: {e}") from None
    from hs_patch.shard import ShardError, parse

    if a.shard:
        try:
            parse(a.shard)
        except ShardError as e:
            raise SystemExit(f"--shard: {e}") from None
    return DriveConfig(**{f.name: getattr(a, f.name) for f in fields(DriveConfig) if f.name != "chat_template_kwargs"},
                       chat_template_kwargs=kwargs)


def run_args(a: argparse.Namespace) -> int:
    from hs_patch.host.driver.run import EXIT_ERROR, EXIT_SIGNAL, Driver
    from hs_patch.host.driver.runstate import RunError

    try:
        driver = Driver(drive_config(a))
    except RunError as e:
        print(f"hs-extract drive: {e}", file=sys.stderr)
        return EXIT_ERROR

    def on_signal(signum: int, _frame: Any) -> None:
        if driver.stop.is_set():
            raise KeyboardInterrupt  # second signal: stop now
        print(f"hs-extract drive: {signal.Signals(signum).name}: finishing the samples in flight, then stopping "
              "(again to stop at once)", file=sys.stderr)
        driver.request_stop(f"stopped by {signal.Signals(signum).name}; run the same command to resume", EXIT_SIGNAL)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        summary = driver.run()
    except (RunError, FileNotFoundError, ValueError, OSError, RuntimeError) as e:
        print(f"hs-extract drive: {e}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    s = summary.status["samples"]
    print(json.dumps({"run": a.run, "state": summary.state, "exit_code": summary.exit_code,
                      "message": summary.message, "samples": s, "tokens": summary.status["tokens"],
                      "bytes_written": summary.status["bytes_written"]}, sort_keys=True))
    return summary.exit_code
