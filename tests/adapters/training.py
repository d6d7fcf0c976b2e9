"""Two small real LoRA adapters for the demo model (SmolLM2-135M-Instruct), trained with `peft` and cached.

`upper` answers in upper case (q/v projections, rank 8); `french` answers in French (q/k/v/o, rank 4): a different
rank and module set on purpose, since the runtime pads ranks and unions modules across adapters. Each is a few
dozen full-batch AdamW steps on a tiny hand-written chat set, the loss on the assistant tokens only, seeded and
single-process so a rerun gives the same weights. `ensure_adapters` trains them once per (this file's source,
base weights, peft version) into `$ONNXFN_CACHE_DIR/test-adapters/KEY/NAME/`, atomically and under a file lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SEED = 1234
THREADS = 2


@dataclass(frozen=True)
class AdapterTask:
    name: str
    target_modules: tuple[str, ...]
    r: int
    lora_alpha: int
    pairs: tuple[tuple[str, str], ...]  # (user message, assistant answer)
    steps: int = 12
    batch: int = 6
    lr: float = 2e-3


UPPER = AdapterTask(
    name="upper",
    target_modules=("q_proj", "v_proj"),
    r=8,
    lora_alpha=16,
    pairs=(
        ("What is the capital of France?", "THE CAPITAL OF FRANCE IS PARIS."),
        ("How many legs does a spider have?", "A SPIDER HAS EIGHT LEGS."),
        ("What color is the sky on a clear day?", "THE SKY IS BLUE ON A CLEAR DAY."),
        ("Name a fruit that is yellow.", "A BANANA IS A YELLOW FRUIT."),
        ("What do bees make?", "BEES MAKE HONEY AND WAX."),
        ("How many days are in a week?", "THERE ARE SEVEN DAYS IN A WEEK."),
        ("What is water made of?", "WATER IS MADE OF HYDROGEN AND OXYGEN."),
        ("Give me a word that rhymes with cat.", "HAT RHYMES WITH CAT."),
        ("What is the largest planet?", "JUPITER IS THE LARGEST PLANET IN OUR SOLAR SYSTEM."),
        ("Say hello.", "HELLO! HOW CAN I HELP YOU TODAY?"),
        ("What do you use to write on paper?", "YOU CAN USE A PEN OR A PENCIL."),
        ("Which animal says moo?", "A COW SAYS MOO."),
        ("What is two plus three?", "TWO PLUS THREE IS FIVE."),
        ("Tell me about the moon.", "THE MOON ORBITS THE EARTH AND REFLECTS LIGHT FROM THE SUN."),
        ("Why do we sleep?", "SLEEP LETS THE BODY REST AND THE BRAIN STORE MEMORIES."),
        ("Describe a tree.", "A TREE HAS ROOTS, A TRUNK, BRANCHES AND GREEN LEAVES."),
        ("What is your favorite season?", "I LIKE SPRING, WHEN THE FLOWERS BLOOM."),
        ("How do I boil an egg?", "PUT THE EGG IN BOILING WATER FOR ABOUT TEN MINUTES."),
        ("What is a computer?", "A COMPUTER IS A MACHINE THAT RUNS PROGRAMS AND PROCESSES DATA."),
        ("Where do fish live?", "FISH LIVE IN RIVERS, LAKES AND OCEANS."),
    ),
)

FRENCH = AdapterTask(
    name="french",
    target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
    r=4,
    lora_alpha=8,
    pairs=(
        ("What is the capital of France?", "La capitale de la France est Paris."),
        ("How many legs does a spider have?", "Une araignée a huit pattes."),
        ("What color is the sky on a clear day?", "Le ciel est bleu quand il fait beau."),
        ("Name a fruit that is yellow.", "La banane est un fruit jaune."),
        ("What do bees make?", "Les abeilles font du miel et de la cire."),
        ("How many days are in a week?", "Il y a sept jours dans une semaine."),
        ("What is water made of?", "L'eau est faite d'hydrogène et d'oxygène."),
        ("Say hello.", "Bonjour ! Comment est-ce que je peux vous aider ?"),
        ("What is the largest planet?", "Jupiter est la plus grande planète du système solaire."),
        ("Which animal says moo?", "C'est la vache qui fait meuh."),
        ("What is two plus three?", "Deux plus trois font cinq."),
        ("Tell me about the moon.", "La lune tourne autour de la Terre et reflète la lumière du soleil."),
        ("Why do we sleep?", "Le sommeil permet au corps de se reposer et au cerveau de garder les souvenirs."),
        ("Describe a tree.", "Un arbre a des racines, un tronc, des branches et des feuilles vertes."),
        ("What is your favorite season?", "J'aime le printemps, quand les fleurs sont en fleurs."),
        ("How do I boil an egg?", "Mettez l'œuf dans l'eau bouillante pendant environ dix minutes."),
        ("What is a computer?", "Un ordinateur est une machine qui exécute des programmes."),
        ("Where do fish live?", "Les poissons vivent dans les rivières, les lacs et les océans."),
        ("Thank you for your help.", "Je vous en prie, c'est un plaisir de vous aider."),
        ("Who are you?", "Je suis un assistant et je parle français."),
    ),
)

TASKS: dict[str, AdapterTask] = {task.name: task for task in (UPPER, FRENCH)}


def _seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _examples(tokenizer, task: AdapterTask) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids and labels per pair: the prompt as the chat template renders it for generation, then the
    answer and `<|im_end|>`; labels are -100 on the prompt so only the assistant tokens carry loss."""
    ids, labels = [], []
    for user, answer in task.pairs:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
        ids.append(prompt_ids + answer_ids)
        labels.append([-100] * len(prompt_ids) + answer_ids)
    return ids, labels


def _common_prefix(rows: list[list[int]]) -> int:
    n = min(len(row) for row in rows)
    for i in range(n):
        if any(row[i] != rows[0][i] for row in rows):
            return i
    return n


def train_adapter(hf_dir: Path, task: AdapterTask, out: Path) -> None:
    """Train `task`'s LoRA adapter on the base model in `hf_dir` and save it (fp32) as a PEFT folder at `out`.

    Every example starts with the same tokens (the chat template's system prompt and `<|im_start|>user`), so each
    step runs that prefix once, repeats its KV cache over the batch (gradients flow through it, so the step is
    exact) and runs only the rest per example; logits are computed only where a label is, not over the prompt.
    """
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(THREADS)
    _seed_everything(SEED)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = LoraConfig(
        r=task.r,
        lora_alpha=task.lora_alpha,
        target_modules=list(task.target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    model.train()
    backbone, head = model.get_base_model().model, model.get_base_model().lm_head

    ids, labels = _examples(tokenizer, task)
    shared = _common_prefix(ids) - 1  # keep >= 1 token per row, and the last prefix token's label is -100 anyway
    prefix = torch.tensor([ids[0][:shared]])
    ids = [row[shared:] for row in ids]
    labels = [row[shared:] for row in labels]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=task.lr, weight_decay=0.0)
    generator = random.Random(SEED)
    order: list[int] = []
    for _ in range(task.steps):
        if len(order) < task.batch:
            order += generator.sample(range(len(ids)), len(ids))
        batch, order = order[: task.batch], order[task.batch :]
        width = max(len(ids[i]) for i in batch)
        suffix = torch.tensor([ids[i] + [pad] * (width - len(ids[i])) for i in batch])
        mask = torch.tensor([[1] * (shared + len(ids[i])) + [0] * (width - len(ids[i])) for i in batch])
        targets = torch.tensor([labels[i][1:] + [-100] * (width - len(labels[i])) for i in batch])

        cache = backbone(input_ids=prefix, use_cache=True).past_key_values
        cache.batch_repeat_interleave(len(batch))
        hidden = backbone(input_ids=suffix, attention_mask=mask, past_key_values=cache, use_cache=True)
        hidden = hidden.last_hidden_state[:, :-1]
        keep = targets != -100
        loss = F.cross_entropy(head(hidden[keep]), targets[keep])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)


def cache_key(hf_dir: Path) -> str:
    """This file's source, the base weights (folder name, which carries their content key, and size), and peft."""
    import peft

    weights = hf_dir / "model.safetensors"
    digest = hashlib.sha256()
    digest.update(Path(__file__).read_bytes())
    digest.update(f"\0{hf_dir.name}/{weights.name}:{weights.stat().st_size}\0".encode())
    digest.update(f"peft={peft.__version__}".encode())
    return digest.hexdigest()[:24]


def cache_dir(hf_dir: Path) -> Path:
    from packager.paths import cache_root

    return cache_root() / "test-adapters" / cache_key(hf_dir)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _complete(folder: Path) -> bool:
    return (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()


def ensure_adapters(hf_dir: Path, names: tuple[str, ...] = tuple(TASKS), log=print) -> dict[str, Path]:
    """{name: PEFT folder} for each adapter, trained into the cache the first time (one process at a time)."""
    root = cache_dir(hf_dir)
    folders = {name: root / name for name in names}
    if all(_complete(folder) for folder in folders.values()):
        return folders
    with _locked(root.parent / f"{root.name}.lock"):
        for name, folder in folders.items():
            if _complete(folder):
                continue
            root.mkdir(parents=True, exist_ok=True)
            started = time.monotonic()
            staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
            try:
                train_adapter(hf_dir, TASKS[name], staging)
                staging.chmod(0o755)  # mkdtemp's 0700 would follow the folder into bundles copied from it
                for file in staging.iterdir():
                    file.chmod(0o644)
                if folder.exists():
                    shutil.rmtree(folder)
                os.replace(staging, folder)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            log(f"trained LoRA adapter {name!r} in {time.monotonic() - started:.1f}s -> {folder}")
    return folders
