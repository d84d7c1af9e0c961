"""The closed loop's phases up to the trainings (tests/gpu/closed_loop.py runs them; the measuring
phases are in loop/measuring.py). Each returns what it recorded; state.json keeps it across calls."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import REC, Server, hs_patch_cli
from loop import controls, corpus, drafters, evalset, features, order, record, target
from loop.fp8arm import Fp8Arm
from loop.measuring import Measuring
from loop.specforge import build_site514, prepare_args

ROOT = Path(__file__).resolve().parents[3]


class Steps(Fp8Arm, Measuring):
    def __init__(self, a: argparse.Namespace, run_id: str):
        self.a = a
        self.work = Path(a.work)
        self.out = Path(a.out)
        self.state_path = self.work / "state.json"
        self.state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {"done": {}}
        self.state["run_id"] = run_id
        self.state.setdefault("settings", {})[time.strftime("%H%M%S")] = vars(a)
        self.t_end = time.time() + a.deadline
        self.target = self.work / "target"
        self.carry = Path(a.carry).resolve()
        self.shm = Path(a.shm)
        self.aux = [int(x) for x in a.aux_layers.split(",")]
        self.lock = threading.RLock()  # the state, as the measuring threads record into it and save it

    # ------------------------------------------------------------------ helpers
    def log(self, *msg: object) -> None:
        REC.log(*msg)

    def left(self) -> float:
        return self.t_end - time.time()

    def sf_env(self, site: str | None = None) -> dict[str, str]:
        """SpecForge's processes: its own --target dir (and SGLang 0.5.14 for its capture)."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = ":".join(p for p in (str(self.work / "sfsite"), site) if p)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def bench_env(self) -> dict[str, str]:
        """SpecForge's benchmark, a client: this checkout and the kit's SGLang first (it imports sglang's frontend),
        SpecForge's own site after them for what the kit lacks (``datasets``, which its benchmarkers import)."""
        env = self.hs_env()
        env["PYTHONPATH"] = f"{env['PYTHONPATH'].rstrip(':')}:{self.work / 'sfsite'}"
        return env

    def hs_env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}

    def hs_extract(self, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hs_patch.host.extract_cli", *args], cwd=ROOT,
                              env=self.hs_env(), capture_output=True, text=True, timeout=timeout)

    def train(self, name: str, feat: Path, seed: int, steps: int | None = None, lr: float | None = None) -> None:
        """``specforge train`` in its own session (it outlives this call); ``train/<name>/rc`` when it ends."""
        d = self.work / "train" / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        (d / "run.yaml").write_text(drafters.run_yaml(
            target=self.target, draft_cfg=self.work / "draft.json", features=feat, out=d / "out", run_id=name,
            steps=steps or self.a.draft_steps, batch=self.a.draft_batch, lr=lr or self.a.draft_lr, seed=seed,
            max_length=2048, cache=d / "cache"))
        cmd = (f"{sys.executable} -m specforge.cli train --config {d / 'run.yaml'} > {d / 'train.log'} 2>&1; "
               f"echo $? > {d / 'rc'}")
        subprocess.Popen(["bash", "-c", cmd], env=self.sf_env(), start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.state.setdefault("trainings", {})[name] = {"features": str(feat), "seed": seed, "started": time.time()}

    def ordered(self, arm: str, src: Path, by_name: bool) -> Path:
        dst = self.work / "train_feat" / arm
        rank = json.loads((self.work / "ranks.json").read_text())
        self.state.setdefault("order", {})[arm] = order.link(src, dst, rank, by_name)
        return dst

    # ------------------------------------------------------------------ phases
    def setup(self) -> dict:
        site = self.work / "sfsite"
        if not (site / "specforge").is_dir():
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--target", str(site), *map(str, sorted((self.carry / "whl").glob("*.whl")))],
                           check=True)
        return {"specforge_site": record.versions(site)}

    def _site514(self) -> Path:
        return build_site514(Path(self.a.site), self.carry / "site514.tar.xz", Path("/tmp/site514"))

    def corpus(self) -> dict:
        import site

        roots = corpus.package_roots(site.getsitepackages() + [site.getusersitepackages()])
        train, held = corpus.build(roots, workers=min(16, os.cpu_count() or 2), max_chars=self.a.max_chars)
        n_d, n_h = self.a.drafter_chats, self.a.heldout
        if len(train) < n_d + 1000 or len(held) < n_h:
            raise RuntimeError(f"only {len(train)} train / {len(held)} held-out chats in {roots}: lower --heldout "
                               "or raise --max-chars")
        step = max(1, len(train) // n_d)
        corpus.write_jsonl(self.work / "target_chats.jsonl", train[:: max(1, len(train) // self.a.target_chats)])
        corpus.write_jsonl(self.work / "drafter_prompts.jsonl", corpus.dedupe(train[::step])[:n_d])
        heldout = held[:: max(1, len(held) // n_h)][:n_h]
        ev = evalset.build(heldout, self.carry / "bench", self.work)
        return {"roots": [str(r) for r in roots], "train_chats": len(train), "heldout_chats": len(held),
                "drafter_chats": n_d, "eval": ev}

    def target_phase(self) -> dict:
        chats = corpus.read_jsonl(self.work / "target_chats.jsonl")
        texts = [target.render(c) for c in chats]
        self.target.mkdir(parents=True, exist_ok=True)
        tok = target.train_tokenizer(texts[:: max(1, len(texts) // 20000)], self.a.vocab, self.target)
        eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
        cfg = target.config(len(tok), hidden=self.a.hidden, layers=self.a.layers, eos_id=eos, pad_id=pad)
        warm = threading.Thread(target=self._warm_kernels, args=(cfg, tok), daemon=True)
        warm.start()
        ids = tok(texts, add_special_tokens=False)["input_ids"]
        blocks = target.packed_blocks(ids, self.a.block, self.a.seed)
        model, stats = target.train(cfg, blocks, steps=self.a.target_steps, batch=self.a.batch, lr=self.a.lr,
                                    seed=self.a.seed, device=self.a.device, log=self.log)
        target.save(model, tok, self.target)
        del model
        warm.join(timeout=max(1, self.left() - 60))
        digest = record.tree_digest(self.target)
        return {**stats, "vocab": len(tok), "blocks": len(blocks), "block_tokens": self.a.block,
                "sha256": digest["sha256_of_listing"], "files": digest["files"], "warm": self.state.get("warm")}

    def _warm_kernels(self, cfg, tok) -> None:
        """A server on random weights of the target's shapes, while the target trains: SGLang's Triton
        kernels compile once (its cache is on disk, shared by every later server)."""
        from transformers import DeepseekV3ForCausalLM

        d = self.work / "target-random"
        t = time.time()
        try:
            target.save(DeepseekV3ForCausalLM(cfg).to(__import__("torch").bfloat16), tok, d)
            # a small pool (the target trains beside it): --max-total-tokens bounds it, not the fraction
            s = Server("warm", str(d), self.a.port + 1, 4096, None, ["--context-length", "4096", "--max-total-tokens",
                                                                     "16384"], mem_fraction=0.9)
            try:
                s.wait_ready()
                s.generate(list(range(10, 300)), "nocap-warm", max_new=64)
            finally:
                s.stop()
            self.state["warm"] = {"s": round(time.time() - t, 1)}
        except Exception as e:  # noqa: BLE001 - only a cost: the capture server compiles instead
            self.state["warm"] = {"error": str(e)[-1500:]}

    def extract(self) -> dict:
        from transformers import AutoTokenizer

        st = hs_patch_cli("apply", "--site", self.a.site)
        assert st["exit_code"] == 0 and st["state"] == "patched", st
        # SpecForge's capture starts here when its 0.5.14 delta came with this call, else in the specforge phase
        # (the kit and the delta may not fit one call's 64 MiB); --sf-shards 0: none (the CPU rehearsal)
        with_sf = self.a.sf_shards > 0 and (self.carry / "site514.tar.xz").exists()
        site514 = ThreadPoolExecutor(1).submit(self._site514) if with_sf else None   # beside the server's start
        cap, samples = self.shm / "loop-capture", self.shm / "loop-samples"
        for d in (cap, samples, self.work / "drive-state"):
            shutil.rmtree(d, ignore_errors=True)
        layers = controls.planes_needed(self.aux)
        server = Server("capture", str(self.target), self.a.port, 4096, {
            "HS_CAPTURE": "1", "HS_CAPTURE_DIR": str(cap), "HS_CAPTURE_LAYERS": ",".join(map(str, layers))},
            ["--context-length", "4096", "--mem-fraction-static", "0.5"])
        res: dict = {"capture_layers": layers}
        try:
            server.wait_ready()
            res["server_start_s"] = server.start_s
            tok = AutoTokenizer.from_pretrained(str(self.target))
            prompts = corpus.read_jsonl(self.work / "drafter_prompts.jsonl")
            ev = corpus.read_jsonl(self.work / "eval.jsonl")
            t = time.time()
            outs = self._answers(server, tok, [c["messages"][:1] for c in prompts] + [r["messages"] for r in ev])
            res["answers_s"] = round(time.time() - t, 1)
            regen, plain = outs[:len(prompts)], outs[len(prompts):]
            chats = corpus.dedupe([{"messages": [c["messages"][0], {"role": "assistant", "content": o["text"]}]}
                                   for c, o in zip(prompts, regen) if o["text"].strip()])
            res["regen"] = {"chats": len(chats), "at_cap": sum(_at_cap(o) for o in regen)}
            res["plain_answers"], res["plain_at_cap"] = len(plain), sum(_at_cap(o) for o in plain)
            rows = [{"sample_id": f"eval.jsonl:{k}", "finish": "length" if _at_cap(o) else "stop",
                     "output_sha256": record_digest(o), "completion_tokens": len(o.get("output_ids") or [])}
                    for k, o in enumerate(plain, 1)]
            (self.work / "plain_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            res["plain_rows_file"] = str(self.work / "plain_rows.jsonl")
            corpus.write_jsonl(self.work / "drafter_chats.jsonl", chats)
            corpus.write_jsonl(self.work / "drafter_chats_sharegpt.jsonl",
                               [corpus.as_sharegpt(c, i) for i, c in enumerate(chats)])
            p = self.hs_extract("drafter-config", "--serve-release", "0.5.16", "--layers", self.a.aux_layers,
                                "--model", str(self.target))
            if p.returncode:
                raise RuntimeError(f"hs-extract drafter-config failed: {p.stderr[-800:]}")
            ids = json.loads(p.stdout)["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
            drafters.draft_config(json.loads((self.target / "config.json").read_text()), ids, self.work / "draft.json")
            if site514 is not None:
                site514.result()
            res["specforge_started"] = self._start_specforge(chats) if with_sf else None
            res["drive"] = self.drive(server, cap, samples, self.work / "drive-state", "loop")
        finally:
            server.stop()
        ours = self.work / "feat" / "ours"
        res["export"] = self.export_features(samples, ours)
        p = self.hs_extract("drafter-config", "--serve-release", "0.5.16", "--export", str(ours), "--model",
                            str(self.target))
        res["drafter_config"] = json.loads(p.stdout) if p.returncode == 0 else {"rc": p.returncode, "err": p.stderr}
        res["features"] = features.summary(ours)
        return res

    def drive(self, server: Server, cap: Path, samples: Path, state_dir: Path, run: str) -> dict:
        """``hs-extract drive`` over the drafter chats into ``samples`` (the fidelity check on, its default)."""
        t = time.time()
        p = self.hs_extract("drive", "--run", run, "--data", str(self.work / "drafter_chats.jsonl"),
                            "--model", str(self.target), "--server", server.url, "--capture-dir", str(cap),
                            "--state-dir", str(state_dir), "--samples-dir", str(samples), "--concurrency", "32")
        res = {"rc": p.returncode, "s": round(time.time() - t, 1), "tail": p.stdout[-1500:] + p.stderr[-1500:]}
        if p.returncode:
            raise RuntimeError(f"hs-extract drive failed: {res}")
        return res

    def export_features(self, samples: Path, dst: Path) -> dict:
        """``hs-extract export --format specforge`` of the aux layers (fp8 samples read dequantized)."""
        shutil.rmtree(dst, ignore_errors=True)
        p = self.hs_extract("export", "--format", "specforge", "--layers", self.a.aux_layers, str(samples), str(dst),
                            "--model", str(self.target), "--json")
        res = {"rc": p.returncode, "out": p.stdout[-800:], "err": p.stderr[-800:]}
        if p.returncode:
            raise RuntimeError(f"hs-extract export failed: {res}")
        return res

    def _answers(self, server: Server, tok, message_lists: list[list[dict]]) -> list[dict]:
        import requests

        def gen(k: int) -> dict:
            body = tok.apply_chat_template(message_lists[k], tokenize=False, add_generation_prompt=True)
            ids = tok(body, add_special_tokens=False)["input_ids"]
            r = requests.post(server.url + "/generate", timeout=900, json={
                "input_ids": ids, "rid": f"nocap-answer-{k}",
                "sampling_params": {"max_new_tokens": self.a.max_new, "temperature": 0.0}})
            r.raise_for_status()
            return r.json()

        with ThreadPoolExecutor(512) as pool:   # all at once: SGLang batches the decode
            return list(pool.map(gen, range(len(message_lists))))

    def _start_specforge(self, chats: list[dict]) -> dict:
        """SpecForge's prepare_hidden_states.py (unmodified, its repository's) under SGLang 0.5.14, in
        --sf-shards processes side by side, each on a contiguous part of the chats, in its own session."""
        k = max(1, self.a.sf_shards)
        per = -(-len(chats) // k)
        started = []
        for i in range(k):
            part = chats[i * per:(i + 1) * per]
            if not part:
                continue
            d = self.work / "sfcap" / f"shard{i}"
            shutil.rmtree(d, ignore_errors=True)
            (d / "scripts").mkdir(parents=True)
            script = shutil.copy(self.carry / "prepare_hidden_states.py", d / "scripts")
            data = d / "chats.jsonl"
            corpus.write_jsonl(data, [corpus.as_sharegpt(c, i * per + j) for j, c in enumerate(part)])
            out = self.work / "feat" / "specforge" / f"shard{i}"
            shutil.rmtree(out, ignore_errors=True)
            env = self.sf_env("/tmp/site514")
            env["TVM_FFI_CACHE_DIR"] = env.get("TVM_FFI_CACHE_DIR", "/tmp/tvm") + "-514"
            args = prepare_args(self.target, data, out, self.work / "draft.json", d / "cache")
            cmd = " ".join([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                            str(script), *args]) + f" > {self.work / 'logs' / f'sf-{i}.log'} 2>&1; echo $? > {d / 'rc'}"
            subprocess.Popen(["bash", "-c", cmd], cwd=d, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            started.append({"shard": i, "chats": len(part)})
        return {"shards": started, "t": time.time()}

    def launch_ours(self) -> dict:
        ext = self.state["done"]["extract"]
        ids = ext["drafter_config"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        drafted = json.loads((self.work / "draft.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        if ids != drafted:
            raise RuntimeError(f"the export's serving ids {ids} are not the draft config's {drafted}")
        ours = self.work / "feat" / "ours"
        (self.work / "ranks.json").write_text(json.dumps(order.ranks(ours)))
        feat = self.ordered("ours", ours, by_name=True)
        for s in range(self.a.seeds):
            self.train(f"ours-s{s}", feat, s)
        self.train("untrained-s0", feat, 0, steps=1, lr=1e-12)   # SpecForge's init, one step at lr ~0
        return {"eagle_ids": ids, "order": self.state["order"]["ours"]}

    def controls(self) -> dict:
        asked = [k for k in self.a.controls.split(",") if k]
        self.start_specforge_capture(required=False)   # beside the controls, when its delta came with this call
        # a call cut short resumes: the controls whose trainings started are not made or trained again
        kinds = [k for k in asked if f"{k}-s0" not in self.state.get("trainings", {})]

        def launch(kind: str) -> None:
            with self.lock:
                feat = self.ordered(kind, self.work / "feat" / kind, by_name=True)
                for s in range(controls.seeds_for(self.a.control_seeds, kind)):
                    self.train(f"{kind}-s{s}", feat, s)
                self.save()

        made = controls.make_all(kinds, self.shm / "loop-samples", self.work / "feat" / "ours", self.work / "feat",
                                 self.aux, workers=len(kinds), done=launch)
        return {"made": made, "resumed": [k for k in asked if k not in kinds],
                "order": {k: self.state["order"].get(k) for k in asked}}

    def start_specforge_capture(self, required: bool = True) -> None:
        """SpecForge's capture started once (by the extract phase when its 0.5.14 delta came with that call, else
        by the first later phase that has it: the controls and fp8 phases start it so that it overlaps them)."""
        ext = self.state["done"]["extract"]
        if ext.get("specforge_started"):
            return
        if not (self.carry / "site514.tar.xz").exists() or self.a.sf_shards <= 0:
            if required:
                raise RuntimeError(f"SpecForge's capture needs {self.carry / 'site514.tar.xz'}: carry .loopcarry")
            return
        self._site514()
        ext["specforge_started"] = self._start_specforge(corpus.read_jsonl(self.work / "drafter_chats.jsonl"))
        self.save()

    def specforge(self) -> dict:
        ext = self.state["done"]["extract"]
        self.start_specforge_capture()
        shards = ext["specforge_started"]["shards"]
        rcs = {}
        while True:
            rcs = {s["shard"]: (self.work / "sfcap" / f"shard{s['shard']}" / "rc") for s in shards}
            if all(p.exists() for p in rcs.values()):
                break
            if self.left() < 30:
                return {"_incomplete": True, "waiting_for": [k for k, p in rcs.items() if not p.exists()]}
            time.sleep(3)
        codes = {k: p.read_text().strip() for k, p in rcs.items()}
        if any(c != "0" for c in codes.values()):
            tails = {k: (self.work / "logs" / f"sf-{k}.log").read_text(errors="replace").splitlines()[-30:]
                     for k, c in codes.items() if c != "0"}
            raise RuntimeError(f"prepare_hidden_states.py failed: {codes} {tails}")
        sf = self.work / "feat" / "specforge"
        feat = self.ordered("specforge", sf, by_name=False)
        for s in range(self.a.seeds):
            self.train(f"specforge-s{s}", feat, s)
        t0 = self.state["done"]["extract"]["specforge_started"]["t"]
        res = {"rcs": codes, "capture_s": round(time.time() - t0, 1), "features": features.summary(sf),
               "order": self.state["order"]["specforge"]}
        res["agreement"] = features.agreement(self.work / "feat" / "ours", sf, features.lm_head_of(self.target),
                                              self.a.device)
        return res


def _at_cap(o: dict) -> bool:
    fin = (o.get("meta_info") or {}).get("finish_reason") or {}
    return (fin.get("type") if isinstance(fin, dict) else fin) == "length"


def record_digest(o: dict) -> str:
    from hs_patch.host.drafter.accept_report import output_digest

    return output_digest([int(t) for t in o.get("output_ids") or []])
