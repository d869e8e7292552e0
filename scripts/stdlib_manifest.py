"""Write tritonllm/data/stdlib_manifest.json, the definition of the embedded corpus, from this Python's
standard library: every file :func:`tritonllm.data.corpus.python_sources` picks (the ``*.py`` files,
sorted, third-party packages and files that are not UTF-8 text left out), with the sha256 of its bytes.

Usage: python scripts/stdlib_manifest.py [out.json]   (the checked-in manifest comes from Python 3.11)

One file per line, so a new manifest's diff reads file by file.
"""

import json
import os
import sys
import sysconfig

from tritonllm.data.corpus import MANIFEST, file_sha256, python_sources


def main(out: str) -> None:
    if sys.version_info[:2] != (3, 11):
        sys.exit(f"the checked-in manifest is written from Python 3.11; this is {sys.version.split()[0]}")
    root = sysconfig.get_paths()["stdlib"]
    files = python_sources(root)
    rows = [json.dumps([os.path.relpath(f, root).replace(os.sep, "/"), file_sha256(f)]) for f in files]
    with open(out, "w") as f:
        f.write(f'{{"python": {json.dumps(sys.version.split()[0])}, "files": [\n' + ",\n".join(rows) + "\n]}\n")
    print(f"wrote {out}: {len(rows)} files of {root} ({sum(os.path.getsize(f) for f in files)} bytes)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else MANIFEST)
