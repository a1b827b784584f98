"""What a process holds in the attributes of its loaded modules and their classes, to compare by identity
before and after an import (tests/test_fairseq_plugin.py runs it in fresh interpreters)."""
import sys
import types
import warnings


def snapshot(packages, registries=()):
    """{(module, attribute or Class.attribute): value} over the loaded modules of ``packages`` (top-level
    names), classes at the module that defines them; for the modules in ``registries`` also every entry of
    their module-level dicts, as (module, "NAME[key]")."""
    seen = {}
    with warnings.catch_warnings():  # reading some of torch's deprecated names warns
        warnings.simplefilter("ignore")
        _read(seen, packages, registries)
    return seen


def _read(seen, packages, registries):
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] not in packages:
            continue
        for attr, value in list(vars(module).items()):
            seen[(name, attr)] = value
            if isinstance(value, type) and value.__module__ == name:
                for cattr, cvalue in list(vars(value).items()):
                    seen[(name, attr + "." + cattr)] = cvalue
            if name in registries and isinstance(value, dict):
                for key, entry in list(value.items()):
                    seen[(name, "{}[{!r}]".format(attr, key))] = entry


def changes(before, after):
    """The keys whose value is another object, or that are new in a module loaded before, except new
    submodules (an import adds them to their package) and warnings' bookkeeping."""
    modules = {module for module, _ in before}
    changed = {k for k in before if k in after and after[k] is not before[k]}
    added = {k for k in after if k not in before and k[0] in modules
             and not isinstance(after[k], types.ModuleType) and k[1] != "__warningregistry__"}
    return changed | added
