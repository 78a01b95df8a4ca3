"""``--bpe hf_tokenizer``: text to a fairseq dictionary's tokens with a Hugging Face
tokenizer.json, for the hub interface of a model imported from transformers
(scripts/import_hf.py writes the tokenizer, renumbered to the model's fairseq ids, beside it):

    ImportedRobertaModel.from_pretrained(DIR, "model.pt", ".", bpe="hf_tokenizer", hf_tokenizer=f"{DIR}/tokenizer.json")
"""

from dataclasses import dataclass, field

from fairseq.data.encoders import register_bpe
from fairseq.dataclass import FairseqDataclass


@dataclass
class HFTokenizerConfig(FairseqDataclass):
    hf_tokenizer: str = field(default="???", metadata={"help": "path to a tokenizers tokenizer.json"})


@register_bpe("hf_tokenizer", dataclass=HFTokenizerConfig)
class HFTokenizerBPE:
    """encode: the tokenizer's tokens (no special tokens), space-separated, as fairseq's
    dictionary reads a line; decode: the tokenizer's own decoding of their ids."""

    def __init__(self, cfg):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(cfg.hf_tokenizer)
        self.tokenizer.no_padding()  # whole texts: the hub and the tasks pad and truncate
        self.tokenizer.no_truncation()
        self.unk_id = 3  # fairseq's <unk>, which import_hf.py gives the tokenizer's unknown token

    def encode(self, x: str) -> str:
        return " ".join(self.tokenizer.encode(x, add_special_tokens=False).tokens)

    def decode(self, x: str) -> str:
        ids = [self.tokenizer.token_to_id(token) for token in x.split()]
        return self.tokenizer.decode([self.unk_id if i is None else i for i in ids])

    def is_beginning_of_word(self, x: str) -> bool:
        return not x.startswith("##")  # WordPiece's continuation mark; BPE tokens carry their space
