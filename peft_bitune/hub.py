"""Bitune adapters on the Hugging Face Hub: pushing with the adapter's own model card, and refusing pickled weights.

`model.push_to_hub(repo_id)` (transformers' `PushToHubMixin`, which `PeftModel` inherits) uploads the adapter, but
replaces the README.md that `save_pretrained` wrote with the card already on the Hub or a generic transformers one;
that card does not say the adapter needs `import peft_bitune`. `push_to_hub(model, repo_id)` here uploads exactly the
files `save_pretrained` writes, with the card's loading lines naming the repo.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import huggingface_hub
from huggingface_hub import CommitInfo, HfApi, file_exists, try_to_load_from_cache
from peft.utils import SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME

from .common import is_bitune_type
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


def refuse_pickled_weights_in(folder: str, not_done: str) -> None:
    """Refuse to save into a folder that holds `adapter_model.bin` (a pickle), which peft-bitune never reads; the
    error ends with `not_done`, what was therefore not written."""
    if os.path.isfile(os.path.join(folder, WEIGHTS_NAME)):
        raise ValueError(
            f"'{folder}' holds {WEIGHTS_NAME} (a pickle, e.g. from an earlier `save_pretrained(..., "
            f"safe_serialization=False)`), which peft-bitune never reads. Bitune adapters are saved as "
            f"{SAFETENSORS_WEIGHTS_NAME} only: delete {WEIGHTS_NAME}, or save into another folder. {not_done}"
        )


def has_only_pickled_weights(model_id: str, subfolder: str | None = None, **hub_kwargs: Any) -> bool:
    """
    Whether PEFT would read `adapter_model.bin` (a pickle) for this adapter because there is no
    `adapter_model.safetensors`: in the local folder, or in the Hub repo (its local cache when offline).
    """
    folder = os.path.join(model_id, subfolder) if subfolder else model_id
    if os.path.isdir(folder):
        return not os.path.isfile(os.path.join(folder, SAFETENSORS_WEIGHTS_NAME)) and os.path.isfile(
            os.path.join(folder, WEIGHTS_NAME)
        )
    revision, repo_type = hub_kwargs.get("revision"), hub_kwargs.get("repo_type")

    def in_repo(name: str) -> bool:
        filename = f"{subfolder}/{name}" if subfolder else name
        if huggingface_hub.constants.HF_HUB_OFFLINE or hub_kwargs.get("local_files_only"):
            cached = try_to_load_from_cache(
                model_id, filename, cache_dir=hub_kwargs.get("cache_dir"), revision=revision, repo_type=repo_type
            )
            return isinstance(cached, str)
        return file_exists(model_id, filename, revision=revision, repo_type=repo_type, token=hub_kwargs.get("token"))

    return not in_repo(SAFETENSORS_WEIGHTS_NAME) and in_repo(WEIGHTS_NAME)
