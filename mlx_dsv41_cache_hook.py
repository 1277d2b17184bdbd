"""Lets any mlx-lm program read prompt-cache files of mlx_dsv41 models.

`mlx_lm.models.cache.load_prompt_cache` rebuilds each cache from its class name, looked up in its
own module, and `python -m mlx_lm generate --prompt-cache-file F` reads F before it loads the model
(whose caches would register our classes there): `KeyError: 'LayerCache'`. So pip installs
`mlx_dsv41_cache_hook.pth` (see setup.py), whose one line runs `install()` when Python starts:
it adds an import hook and nothing else. When a program imports `mlx_lm.models.cache`, the hook
adds stand-ins named like our cache classes; a stand-in's `from_state` imports mlx_dsv41 (only
then: other mlx-lm programs never import it) and builds the real cache.

This module is top level, not part of the mlx_dsv41 package, so that running it imports nothing.
"""

import sys

TARGET = "mlx_lm.models.cache"
CLASS_NAMES = ("LayerCache", "EngramHistory")  # mlx_dsv41.cache's classes, as saved in the files


def stand_in(name: str) -> type:
    """A class `name` whose from_state builds mlx_dsv41.cache.<name> (mlx_dsv41.cache then
    registers its real classes over the stand-ins)."""

    def from_state(cls, state):
        from mlx_dsv41 import cache

        cache.register_with_mlx_lm()
        return getattr(cache, name).from_state(state)

    return type(
        name,
        (),
        {
            "from_state": classmethod(from_state),
            "mlx_dsv41_stand_in": True,
            "__doc__": f"Stands in for mlx_dsv41.cache.{name} until it is imported.",
        },
    )


def add_stand_ins(module) -> None:
    for name in CLASS_NAMES:
        if not hasattr(module, name):
            setattr(module, name, stand_in(name))


class Finder:
    """A meta-path finder that finds nothing itself: it wraps the loader of `mlx_lm.models.cache`
    so the stand-ins are added right after the module runs."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and hasattr(spec.loader, "exec_module"):
                run = spec.loader.exec_module

                def exec_module(module, run=run):
                    run(module)
                    add_stand_ins(module)

                spec.loader.exec_module = exec_module
                return spec
        return None


def install() -> None:
    if TARGET in sys.modules:
        add_stand_ins(sys.modules[TARGET])
    elif not any(isinstance(f, Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, Finder())
