"""Pushing a run to the Hugging Face hub: the token checked up front, uploads in the background.

Whether the hub is reachable at all is `utils.base.hub_probe`'s question.
"""

import logging

from utils.base.errors import UsageError
from utils.base.hub_probe import endpoint
from utils.checkpoints.store import CHECKPOINT_SUBDIR

logger = logging.getLogger(__name__)


def check_token(token):
    """Fail now, not at the first save after hours of training, if the hub rejects the token."""
    from huggingface_hub import HfApi

    try:
        HfApi(token=token).whoami()
    except OSError as e:  # requests' HTTP and connection errors, and a missing token
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(f"the hub at {endpoint()} does not accept the token for --push_to_hub: {first}; "
                         "pass a valid --hub_token (with write access) or log in with huggingface-cli login") from e


class HubPusher:
    """Uploads `output_dir` (minus checkpoints) to a hub repo in the background.

    The repo is created up front so a bad token or name fails before training. The token goes to
    `HfApi` only: it is never logged or kept as an attribute here.
    """

    def __init__(self, repo_id: str, token: str, output_dir: str, private: bool | None = None):
        from huggingface_hub import HfApi

        self.repo_id = repo_id
        self.output_dir = output_dir
        self._api = HfApi(token=token)
        self._api.create_repo(repo_id, private=private, exist_ok=True)
        self._futures = []

    def push(self, commit_message: str):
        """Start an upload of the current contents of `output_dir`; returns without waiting."""
        logger.info("Pushing %s to the hub repo %s", self.output_dir, self.repo_id)
        future = self._api.upload_folder(
            repo_id=self.repo_id,
            folder_path=self.output_dir,
            commit_message=commit_message,
            run_as_future=True,
            ignore_patterns=[f"{CHECKPOINT_SUBDIR}/*", "*.orbax-checkpoint-tmp*", ".export-*"],
        )
        self._futures.append(future)

    def wait(self):
        """Wait for every pending upload; re-raises the first upload error."""
        futures, self._futures = self._futures, []
        for future in futures:
            future.result()
