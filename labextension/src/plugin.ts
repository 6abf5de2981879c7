/**
 * The JupyterLab plugin: registers the `slapo-lab` widget module (GraphModel,
 * GraphView) with the Jupyter widget manager.
 */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { IJupyterWidgetRegistry } from '@jupyter-widgets/base';

import { MODULE_NAME, MODULE_VERSION } from './version';
import * as widgetExports from './widget';

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'slapo-lab:plugin',
  description: 'The slapo-lab graph widget (a sanitised, zoomable graphviz view).',
  requires: [IJupyterWidgetRegistry],
  autoStart: true,
  activate: (_app: JupyterFrontEnd, registry: IJupyterWidgetRegistry): void => {
    registry.registerWidget({
      name: MODULE_NAME,
      version: MODULE_VERSION,
      exports: widgetExports
    });
  }
};

export default plugin;
