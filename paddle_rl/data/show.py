"""`paddle-rl data show CONFIG [-n 3] [key=value ...]`: the first records of a config's datasets as the model will
see them, before any training.

For each of the first N records of every file in train_datasets and eval_datasets: the prompt exactly as the model
receives it (the token ids decoded back, special tokens visible, cut to max_prompt_len as training cuts it), its
token count, how it was made (used as it is, templated, or PaddleNLP turns joined: records.ChatForm with the
config's apply_chat_template), and the label as the reward rules read it. A record the run would refuse is printed
with the reason, and the command ends with status 1.
"""
import json
import sys

from ..config import load_config
from ..config.loader import dataset_paths
from ..model_files.hub import resolve_model
from .loader import DatasetError, iter_records
from .records import AS_IS, JOINED, TEMPLATED, ChatForm, RecordError, to_prompt_record

FORMS = {AS_IS: "used as it is (already in the tokenizer's chat form, or apply_chat_template: false)",
         TEMPLATED: "put through the tokenizer's chat template",
         JOINED: "PaddleNLP turns joined as written (each assistant turn followed by the eos token)"}


def _label(truth) -> str:
    if truth is None:
        return "(none)"
    return truth if isinstance(truth, str) else json.dumps(truth, ensure_ascii=False)


def show_records(config, n: int, out=None) -> int:
    """Print the first `n` records of each data file (to `out`, default the current sys.stdout); the number of
    records that could not be read."""
    out = out or sys.stdout
    # deferred: importing paddle_rl.models loads Paddle, which `paddle-rl --help` (this module registers a
    # subcommand) must not
    from ..models.tokenizer import Tokenizer
    folder = resolve_model(config.tokenizer_name_or_path or config.actor_model_name_or_path)
    tokenizer = Tokenizer.from_pretrained(folder)
    chat = ChatForm(tokenizer, config.apply_chat_template, config.system_prompt)
    refused = 0
    markers = ", ".join(chat.markers) if chat.markers else "none"
    print(f"tokenizer: {folder} (chat template: {'yes' if chat.has_template else 'no'}; turn markers: {markers}; "
          f"apply_chat_template: {config.apply_chat_template})", file=out)
    for key in ("train_datasets", "eval_datasets"):
        for path in dataset_paths(getattr(config, key)):
            for shown, (location, _, raw) in enumerate(iter_records(path)):
                if shown >= n:
                    break
                print(f"\n=== {location} ({key})", file=out)
                try:
                    item = to_prompt_record(raw, config.prompt_key, config.response_key, chat,
                                            require_ground_truth=False)
                except RecordError as e:
                    refused += 1
                    print(f"refused: {e}", file=out)
                    continue
                ids = tokenizer.encode(item["prompt"])
                cut = len(ids) - config.max_prompt_len
                note = (f"; over max_prompt_len={config.max_prompt_len}: its first {cut} tokens are "
                        f"{'cut' if config.prompt_overflow == 'truncate' else 'dropped with the record'}"
                        if cut > 0 else "")
                print(f"prompt: {len(ids)} tokens, {FORMS[item['prompt_form']]}{note}", file=out)
                print("----- as the model sees it -----", file=out)
                print(tokenizer.decode(ids[-config.max_prompt_len:]), file=out)
                print("----- end of prompt -----", file=out)
                print(f"label (as the rules read it): {_label(item['ground_truth'])}", file=out)
                if item["data_source"]:
                    print(f"data_source: {item['data_source']}", file=out)
    return refused


def run_show(args) -> int:
    try:
        config = load_config(args.config, args.overrides, warn_unused=False)
        if not (config.train_datasets or config.eval_datasets):
            print("error: train_datasets / eval_datasets: the config names no data file", file=sys.stderr)
            return 2
        refused = show_records(config, args.n)
    except (ValueError, OSError, DatasetError) as e:  # ConfigError, a missing file or tokenizer: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1 if refused else 0


def add_show_subparser(subparsers) -> None:
    p = subparsers.add_parser("show", help="print the first records of a config's datasets as the model sees them",
                              description=__doc__.split("\n\n")[1])
    p.add_argument("config", nargs="?", default=None, help="YAML argument file (optional with overrides / flags)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of the file's keys")
    p.add_argument("-n", type=int, default=3, help="records shown from each file (default 3)")
    p.set_defaults(func=run_show, takes_overrides=True)
