"""Bitune adapters on the Hugging Face Hub: pushing with the adapter's own model card.

`model.push_to_hub(repo_id)` (transformers' `PushToHubMixin`, which `PeftModel` inherits) uploads the adapter, but
replaces the README.md that `save_pretrained` wrote with the card already on the Hub or a generic transformers one;
that card does not say the adapter needs `import peft_bitune`. `push_to_hub(model, repo_id)` here uploads exactly the
files `save_pretrained` writes, with the card's loading lines naming the repo.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from huggingface_hub import CommitInfo, HfApi

from ..constants import is_bitune_type
from .model_card import write_model_card


def push_to_hub(
    model: Any,
    repo_id: str,
    *,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    api: HfApi | None = None,
) -> CommitInfo:
    """
    Save a Bitune `PeftModel` with `save_pretrained` and upload those files to the Hub repo `repo_id`.

    Args:
        model (`PeftModel`): the model holding the Bitune adapter(s); every adapter is pushed, as `save_pretrained`
            saves them (the adapter `"default"` at the root, others in a subfolder of their name).
        repo_id (`str`): `"user/name"`; the repo is created if it does not exist.
        commit_message (`str`, *optional*): defaults to `"Upload Bitune adapter"`.
        commit_description (`str`, *optional*): the description of the commit.
        private (`bool`, *optional*): visibility of a newly created repo (ignored by the Hub if it exists).
        token (`str` or `bool`, *optional*): Hub token; by default the one from `hf auth login`.
        revision (`str`, *optional*): the branch to push to; created if missing.
        create_pr (`bool`, defaults to `False`): open a pull request instead of committing.
        api (`HfApi`, *optional*): the client to use (e.g. one configured with an endpoint).

    Returns:
        The `huggingface_hub.CommitInfo` of the upload.
    """
    configs = getattr(model, "peft_config", {})
    if not configs or not all(is_bitune_type(getattr(config, "peft_type", None)) for config in configs.values()):
        raise TypeError(f"`push_to_hub` pushes a PeftModel with Bitune adapters, got a {type(model).__name__}.")
    api = api or HfApi()
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        for adapter_name, config in configs.items():
            subfolder = None if adapter_name == "default" else adapter_name
            write_model_card(os.path.join(folder, subfolder or ""), config, repo_id, subfolder=subfolder)
        repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
        if revision is not None and not revision.startswith("refs/pr"):
            api.create_branch(repo_id=repo_id, branch=revision, token=token, exist_ok=True)
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            commit_message=commit_message or "Upload Bitune adapter",
            commit_description=commit_description,
            token=token,
            revision=revision,
            create_pr=create_pr,
        )
