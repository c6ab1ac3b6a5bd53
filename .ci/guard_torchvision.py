"""Make PyPI's torchvision importable beside a CPU build of torch (.ci/zoo_requirements.txt).

PyPI's torchvision is a CUDA build: its ops library (_C.so) does not load with the CPU torch, and
then two unguarded fake-kernel registrations (nms, qnms) make `import torchvision` fail, and with it
`import lightning` (torchmetrics imports torchvision when installed). This guards them as
torchvision guards the others: idempotent, and a no-op where the ops load. Its Python parts work;
its C++ ops do not.
"""

import importlib.util
import pathlib
import re

spec = importlib.util.find_spec("torchvision")
if spec is not None and spec.origin is not None:
    path = pathlib.Path(spec.origin).parent / "_meta_registrations.py"
    text, n = re.subn(
        r'^@torch\.library\.register_fake\(("torchvision::\w+")\)$',
        r"@(torch.library.register_fake(\1) if torchvision.extension._has_ops()"
        r" else (lambda fn: fn))",
        path.read_text(),
        flags=re.MULTILINE,
    )
    if n:
        path.write_text(text)
