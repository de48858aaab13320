"""The lines a subprocess runs first to use Triton's CPU interpreter (TRITON_INTERPRET=1) with numpy >= 2.4."""

PRELUDE = '''
import triton.runtime.interpreter as ti
_orig = ti._patch_lang_tensor
def _patched(tensor, scope):  # numpy >= 2.4 refuses int() of a 1-element array; triton 3.6 relies on it
    _orig(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
ti._patch_lang_tensor = _patched
'''
