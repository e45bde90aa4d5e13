"""Print the project's requirements from pyproject.toml, one per line.

The images install the dependencies in a layer of their own, before the
source is copied in, so editing the code does not reinstall vLLM:
``python docker/requirements.py pyproject.toml engine > req.txt``. The build
backend's requirements are included, so a build without an index (wheels
only) can still build the project itself.
"""

from __future__ import annotations

import sys
import tomllib


def requirements(pyproject: str, extras: list[str]) -> list[str]:
    with open(pyproject, "rb") as f:
        data = tomllib.load(f)
    project = data["project"]
    out = list(data["build-system"]["requires"]) + list(project["dependencies"])
    for extra in extras:
        out.extend(project["optional-dependencies"][extra])
    return out


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1], sys.argv[2:])))
