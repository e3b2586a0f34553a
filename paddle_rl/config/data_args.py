from dataclasses import dataclass

from .fields import arg


@dataclass
class DataArgs:
    train_datasets: str = arg("", "Training prompts: jsonl/parquet file(s), comma separated.")
    eval_datasets: str = arg("", "Held-out prompts for evaluation, comma separated (with several files, eval/<file>/* "
                                 "metrics per file besides the overall eval/*).")
    prompt_key: str = arg("src", "Record key of the prompt.")
    response_key: str = arg("tgt", "Record key of the label / ground truth.")
    apply_chat_template: str = arg("auto", "How prompts meet the tokenizer's chat template (one rule for every record "
                                           "format): auto uses a prompt already in the template's chat form as it "
                                           "is and templates a plain question as a user turn (messages always); "
                                           "true templates every prompt and refuses one already templated; false "
                                           "never templates (PaddleNLP's reader: turns joined as written) and "
                                           "refuses messages. docs/formats.md.",
                                   choices=("auto", "true", "false"),
                                   spellings={"yes": "true", "no": "false", "on": "true", "off": "false"})
    system_prompt: str = arg("", "A system turn put first in every prompt the chat template renders (plain questions, "
                                 "messages without a system turn of their own; ms-swift's --system). A prompt used as "
                                 "written (already in chat form, or apply_chat_template: false) is refused with it.")
    max_prompt_len: int = arg(512, "Prompts longer than this (in tokens) are truncated or dropped.")
    prompt_overflow: str = arg("truncate", "What to do with prompts over max_prompt_len: truncate (keep the end) | drop.")
    dataloader_drop_last: bool = arg(False, "Drop the last incomplete batch of an epoch.")
    dataloader_shuffle: bool = arg(True, "Shuffle prompts each epoch (seeded).")
    max_eval_samples: int = arg(-1, "Evaluate on at most this many held-out prompts (-1: all).")

    def _validate_data(self, errors):
        if self.max_prompt_len <= 0:
            errors.append(f"max_prompt_len: must be > 0, got {self.max_prompt_len}")
        if self.prompt_overflow not in ("truncate", "drop"):
            errors.append(f"prompt_overflow: must be truncate or drop, got {self.prompt_overflow!r}")
