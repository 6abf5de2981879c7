/**
 * The JupyterLab plugin: registers the `slapo-lab` widget module (GraphModel, GraphView, and
 * FormButtonModel / FormButtonView: a button whose click carries its form's values) with the
 * Jupyter widget manager, and the schedule editor's commands (editor.ts): its own panel, keyboard
 * shortcuts (key bindings in labextension/schema/plugin.json) and context menus.
 */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { IJupyterWidgetRegistry } from '@jupyter-widgets/base';

import { EditorCommands } from './editor';
import { FormButtonModel, FormButtonView } from './form_button';
import { MODULE_NAME, MODULE_VERSION } from './version';
import { GraphModel, GraphView } from './widget';

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'slapo-lab:plugin',
  description: 'The slapo-lab graph widget (a sanitised, zoomable graphviz view) and the schedule editor commands.',
  requires: [IJupyterWidgetRegistry],
  optional: [ICommandPalette],
  autoStart: true,
  activate: (app: JupyterFrontEnd, registry: IJupyterWidgetRegistry, palette: ICommandPalette | null): void => {
    registry.registerWidget({
      name: MODULE_NAME,
      version: MODULE_VERSION,
      exports: { GraphModel, GraphView, FormButtonModel, FormButtonView }
    });
    new EditorCommands(app).activate(palette);
  }
};

export default plugin;
