"""The pipeline's model folders (``pi_ref``, the PPO policies, the SPRMs, ``pi_hind``) as MLflow
logged models: listed in a run's Models column and loadable with ``mlflow.pyfunc.load_model``.

One copy of the weights: ``mlflow.pyfunc.log_model(artifacts={"model": folder})`` would first
copy the folder into a temporary model folder and then upload that, two copies of what can be
gigabytes on a GPU run (and the flows used to upload it a third time as run artifacts). Instead
the pyfunc is logged with an empty placeholder as its ``model`` artifact, which gives the
MLmodel file its entry ``artifacts/<placeholder>``, and the folder is uploaded straight into
that place of the logged model (``MlflowClient.log_model_artifacts``); the model is marked
READY once the weights are there. Loading it downloads the whole logged model, so the pyfunc
finds the folder where the entry says."""

import tempfile
import warnings
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd

#: What ``predict`` does, per kind of folder.
KINDS = {
    "policy": "greedy continuation of each text (params: max_new_tokens, default 32)",
    "pi_hind": "mean token NLL of each text, without a hindsight block",
    "sprm": "the SPRM's reward read at the last token of each text (a segment ending there)",
}


def _texts(model_input: Any) -> list[str]:
    """A pandas DataFrame's first column, a list of strings or one string."""
    if hasattr(model_input, "iloc"):
        frame = model_input.to_frame() if hasattr(model_input, "to_frame") else model_input
        return [str(t) for t in frame.iloc[:, 0]]
    if isinstance(model_input, str):
        return [model_input]
    return [str(t) for t in model_input]


class FolderModel(mlflow.pyfunc.PythonModel):
    """A model folder of the pipeline as a pyfunc; ``model`` and ``tokenizer`` after loading
    are the objects the pipeline itself uses (``unwrap_python_model()`` reaches them)."""

    def __init__(self, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown model kind {kind!r}; one of {', '.join(KINDS)}")
        self.kind = kind

    def load_context(self, context: Any) -> None:
        from hisr_core.agent.models import load_model, load_tokenizer
        from hisr_core.rewards.gated_attention import load_gated
        from hisr_core.rewards.sprm import load_sprm

        folder = context.artifacts["model"]
        loaders = {"policy": load_model, "pi_hind": load_gated,
                   "sprm": lambda path: load_sprm(path)[0]}
        self.model = loaders[self.kind](folder).eval()
        self.tokenizer = load_tokenizer(folder)

    # (No ``from __future__ import annotations`` here: MLflow reads this hint as a type.)
    # A DataFrame hint, which MLflow does not turn into a signature (a list[str] one would
    # leave no room for params): the logged model carries an explicit one (log_model_folder),
    # under which a list of strings arrives as a one-column DataFrame.
    def predict(self, context: Any, model_input: pd.DataFrame,
                params: dict[str, Any] | None = None) -> list:
        import torch

        out: list[Any] = []
        with torch.no_grad():
            for text in _texts(model_input):
                ids = self.tokenizer(text, return_tensors="pt").input_ids
                if self.kind == "policy":
                    new = self.model.generate(
                        ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=int((params or {}).get("max_new_tokens", 32)),
                        pad_token_id=self.tokenizer.pad_token_id)[0, ids.shape[1]:]
                    out.append(self.tokenizer.decode(new, skip_special_tokens=True))
                elif self.kind == "pi_hind":
                    out.append(float(self.model(input_ids=ids, labels=ids).loss))
                else:
                    last = torch.tensor([ids.shape[1] - 1])
                    out.append(float(self.model.rewards_at(ids, torch.tensor([0]), last)[0]))
        return out


def _requirements() -> list[str]:
    """What loading needs besides MLflow (given, so MLflow does not load the model to infer
    them); the project's own code comes from its installed package (``pip install -e .``)."""
    import safetensors
    import torch
    import transformers

    return [f"torch=={torch.__version__.split('+')[0]}",
            f"transformers=={transformers.__version__}",
            f"safetensors=={safetensors.__version__}"]


def run_models(run_id: str) -> dict[str, Any]:
    """The logged models of a run, by name (the newest of a name)."""
    client = mlflow.MlflowClient()
    outputs = client.get_run(run_id).outputs
    models = [client.get_logged_model(o.model_id)
              for o in (outputs.model_outputs if outputs else [])]
    return {m.name: m for m in sorted(models, key=lambda m: m.creation_timestamp)}


def log_model_folder(folder: Path, name: str, kind: str, tags: dict[str, str]) -> str:
    """Log ``folder`` as the logged model ``name`` of the active run (see the module
    docstring), unless the run holds it already (a stage rerun that continues its run, e.g.
    PPO resumed from a finished checkpoint); returns its ``models:/<model_id>`` URI."""
    from mlflow.entities import LoggedModelStatus
    from mlflow.models import infer_signature

    from tasks.caching import content_hash

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} is not a model folder (no config.json)")
    # The caching layer has hashed the folder already (its task output): no second read.
    digest = content_hash(folder)
    same = run_models(mlflow.active_run().info.run_id).get(name)
    if same is not None and same.tags.get("hisr.content") == digest:
        return f"models:/{same.model_id}"
    # The signature says what predict takes and returns (and lets callers pass params).
    signature = infer_signature(["a text"], ["more text"] if kind == "policy" else [0.5],
                                params={"max_new_tokens": 32} if kind == "policy" else None)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        # An input example would make MLflow run the model while logging it, before its
        # weights are in place; the signature says what it takes.
        warnings.filterwarnings("ignore", message=".*input example was not provided")
        placeholder = Path(tmp) / "model"
        placeholder.mkdir()
        info = mlflow.pyfunc.log_model(
            name=name, python_model=FolderModel(kind), artifacts={"model": str(placeholder)},
            signature=signature, pip_requirements=_requirements(),
            tags={**tags, "hisr.kind": kind, "hisr.content": digest},
            metadata={"predict": KINDS[kind]})
    place = info.flavors["python_function"]["artifacts"]["model"]["path"]
    client = mlflow.MlflowClient()
    client.log_model_artifacts(info.model_id, str(folder), artifact_path=place)
    client.finalize_logged_model(info.model_id, LoggedModelStatus.READY)
    return f"models:/{info.model_id}"
