/**
 * The widget module name and version, as the Python side sends them in
 * `_model_module` / `_model_module_version` (which is the semver range
 * `^MODULE_VERSION`). Keep MODULE_VERSION equal to the `version` of the root
 * package.json: tests/test_labextension.py checks it.
 */
export const MODULE_NAME = 'slapo-lab';
export const MODULE_VERSION = '0.1.0';
