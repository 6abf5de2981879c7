/**
 * FormButtonModel / FormButtonView: an ipywidgets Button whose click carries
 * the page's values of the form it submits (see slapo_lab/editor/form_button.py).
 *
 * A click is a custom message, which @jupyter-widgets/base sends at once,
 * while a widget's state update may be held back until that widget's previous
 * update is answered (WidgetModel.sync's message throttle). So the click sends,
 * with itself, the state this page shows for each widget of the synced `form`
 * list: {event: 'click', form: [{index: i} | {value: v}, ...]}, `index` for
 * selection widgets (Dropdown syncs its index, not its value), `value` for the
 * others. The kernel applies them before it runs the click handlers.
 */
import { unpack_models, WidgetModel, ISerializers } from '@jupyter-widgets/base';
import { ButtonModel, ButtonView } from '@jupyter-widgets/controls';

import { MODULE_NAME, MODULE_VERSION } from './version';

export class FormButtonModel extends ButtonModel {
  defaults(): Record<string, unknown> {
    return {
      ...super.defaults(),
      _model_name: 'FormButtonModel',
      _model_module: MODULE_NAME,
      _model_module_version: MODULE_VERSION,
      _view_name: 'FormButtonView',
      _view_module: MODULE_NAME,
      _view_module_version: MODULE_VERSION,
      form: []
    };
  }

  static serializers: ISerializers = {
    ...ButtonModel.serializers,
    form: { deserialize: unpack_models }
  };
}

/** The state this page shows for one form widget: its `index` when it has one, else its `value`. */
export function formState(model: WidgetModel): { [key: string]: unknown } {
  const index = model.get('index');
  return index !== undefined ? { index } : { value: model.get('value') };
}

export class FormButtonView extends ButtonView {
  _handle_click(event: MouseEvent): void {
    event.preventDefault();
    const form = (this.model.get('form') || []) as WidgetModel[];
    this.send({ event: 'click', form: form.map(formState) });
  }
}
