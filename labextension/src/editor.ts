/**
 * The schedule editor in JupyterLab: its own panel, keyboard shortcuts, context menus.
 *
 * - Panel: the kernel's `editor.open()` sends {cmd: 'open_panel', model_id} through the
 *   GraphWidget's comm; `openPanel` creates another view of that widget model (the editor's panel
 *   layout, same kernel, same schedule) with the widget manager's `create_view` and adds it to the
 *   main area split to the right of the notebook (as "Create New View for Cell Output" does). The
 *   command `slapo-lab:open-panel` (palette, and the context menu over an editor) asks the kernel
 *   for it.
 * - Keys: JupyterLab commands `slapo-lab:*` whose key bindings (selector `.slapo-editor`, defined in
 *   labextension/schema/plugin.json, rebindable in Settings) are matched by a keydown listener on
 *   the editor element itself: a key we handle is stopped there (stopPropagation), so the notebook's
 *   command-mode shortcuts never see it; other single keys (x, d, a, b, arrows, Enter ...) are
 *   stopped too while focus is in the editor, outside its text fields.
 * - Context menus on graph nodes and tree rows: the node (row) is selected first, the kernel
 *   answers with `action_reasons` for it, then a Lumino menu opens with each action enabled or
 *   disabled with its one-sentence reason.
 */
import { JupyterFrontEnd } from '@jupyterlab/application';
import { Dialog, ICommandPalette, showDialog } from '@jupyterlab/apputils';
import { CommandRegistry } from '@lumino/commands';
import { ReadonlyJSONObject, ReadonlyPartialJSONObject } from '@lumino/coreutils';
import { Menu, Panel, Widget } from '@lumino/widgets';

import { Direction, GraphModel, GraphView, liveViews, setMenuHandler, setPanelHandler } from './widget';

/** Palette category and command-id prefix. */
export const CATEGORY = 'slapo-lab';
const P = 'slapo-lab:';

/** Actions the kernel runs (GraphWidget ACTIONS), with their command ids and labels. */
interface IActionCommand {
  id: string;
  action: string;
  label: string;
  /** The label in a context menu (the kernel may send a more precise one in action_labels). */
  menuLabel: string;
}

const ACTION_COMMANDS: IActionCommand[] = [
  { id: `${P}undo`, action: 'undo', label: 'Undo the last schedule action', menuLabel: 'Undo' },
  { id: `${P}redo`, action: 'redo', label: 'Redo the last undone schedule action', menuLabel: 'Redo' },
  { id: `${P}checkpoint`, action: 'checkpoint', label: 'Checkpoint the selected module', menuLabel: 'Checkpoint' },
  { id: `${P}cut`, action: 'cut', label: 'Cut a pipeline stage after the selected module', menuLabel: 'Cut pipeline stage here' },
  { id: `${P}shard`, action: 'shard', label: 'Shard the selected module', menuLabel: 'Shard…' },
  { id: `${P}sync`, action: 'sync', label: 'Sync the selected module', menuLabel: 'Sync…' },
  { id: `${P}open-level`, action: 'open', label: 'Open the selected module (show its submodules)', menuLabel: 'Open level' },
  { id: `${P}up`, action: 'up', label: 'Go up one level', menuLabel: 'Up one level' },
  { id: `${P}select-similar`, action: 'similar', label: 'Select the similar modules of every repeated block', menuLabel: 'Select similar' }
];

const MOVES: { id: string; dir: Direction; label: string }[] = [
  { id: `${P}move-left`, dir: 'left', label: 'Graph: go to the node on the left' },
  { id: `${P}move-right`, dir: 'right', label: 'Graph: go to the node on the right' },
  { id: `${P}move-up`, dir: 'up', label: 'Graph: go to the node above (its input)' },
  { id: `${P}move-down`, dir: 'down', label: 'Graph: go to the node below (its output)' }
];

export const OPEN_PANEL = `${P}open-panel`;
export const FOCUS_SEARCH = `${P}focus-search`;
export const SHORTCUTS = `${P}shortcuts`;

/** Keys a focused listbox (the module tree) handles itself. */
const NATIVE_LIST_KEYS = new Set(['ArrowUp', 'ArrowDown', 'ArrowLeft', 'ArrowRight', 'Home', 'End', 'PageUp', 'PageDown']);
/** Keys kept from the notebook while focus is in the editor (its command mode would act on cells). */
const GUARDED_KEYS = new Set([
  'Enter', 'Backspace', 'Delete', 'ArrowUp', 'ArrowDown', 'ArrowLeft', 'ArrowRight', 'Home', 'End', 'PageUp', 'PageDown'
]);
/** How long a context menu waits for the kernel's reasons for a newly selected module (ms). */
const REASONS_WAIT_MS = 4000;

function isTextField(el: Element): boolean {
  if (el instanceof HTMLTextAreaElement || (el instanceof HTMLElement && el.isContentEditable)) {
    return true;
  }
  if (el instanceof HTMLInputElement) {
    return !['checkbox', 'radio', 'button', 'submit', 'reset', 'range', 'color', 'file'].includes(el.type);
  }
  return false;
}

/** The GraphView inside editor element `editor` (the one in this very element, not a nested one). */
export function viewOf(editor: Element | null): GraphView | null {
  if (!editor) {
    return null;
  }
  for (const view of liveViews) {
    if (editor.contains(view.el) && view.el.closest('.slapo-editor') === editor) {
      return view;
    }
  }
  return null;
}

/**
 * Resolves when the kernel sent reasons for another module than the one they are for now (the one just
 * selected), or after `ms`. Reasons re-sent for the old module meanwhile (background work refreshes them)
 * do not count: a menu opened on them would show the previous module's reasons.
 */
function nextReasons(view: GraphView, ms: number): Promise<void> {
  return new Promise(resolve => {
    const model = view.model;
    const before = model.get('action_target');
    let timer = 0;
    const finish = () => {
      window.clearTimeout(timer);
      model.off('change:action_target', check);
      model.off('change:action_reasons', check);
      resolve();
    };
    const check = () => {
      if (model.get('action_target') !== before) {
        finish();
      }
    };
    model.on('change:action_target', check);
    model.on('change:action_reasons', check);
    timer = window.setTimeout(finish, ms);
  });
}

/** The tree row's indentation depth (one em space per level) and its text without the ▸ / ▾ mark. */
function treeRow(option: HTMLOptionElement): { depth: number; text: string } {
  const label = (option.textContent || '').replace(/\u00a0/g, ' '); // ipywidgets draws spaces as no-break
  let depth = 0;
  while (label.charAt(depth) === '\u2003') {
    depth++;
  }
  return { depth, text: label.slice(depth).replace(/^[\u25b8\u25be] /, '') };
}

/**
 * "encoder.layer.0.attention · BertAttention" for an indented tree row: its name and those of the rows above
 * it one level less indented, up to the model row (depth 0). Search results (no indentation) already show the
 * full path.
 */
export function treeRowTitle(option: HTMLOptionElement): string {
  const { depth, text } = treeRow(option);
  if (depth === 0) {
    return text;
  }
  const sep = text.lastIndexOf(' · ');
  const names = [sep >= 0 ? text.slice(0, sep) : text];
  let want = depth - 1;
  for (let o = option.previousElementSibling; o && want >= 1; o = o.previousElementSibling) {
    if (!(o instanceof HTMLOptionElement)) {
      continue;
    }
    const row = treeRow(o);
    if (row.depth === want) {
      const cut = row.text.lastIndexOf(' · ');
      names.unshift(cut >= 0 ? row.text.slice(0, cut) : row.text);
      want--;
    }
  }
  return names.join('.') + (sep >= 0 ? text.slice(sep) : '');
}

export class EditorCommands {
  constructor(private _app: JupyterFrontEnd) {}

  /** The editor element focused or clicked last (palette commands act on it). */
  private _lastEditor: HTMLElement | null = null;
  /** The view a context menu is open for. */
  private _menuView: GraphView | null = null;
  /** Whether the last key came from inside the graph box (Enter then opens the node under the cursor). */
  private _keyInGraph = false;
  private _wired = new WeakSet<Element>();
  private _panels = new Map<string, Widget>();

  activate(palette: ICommandPalette | null): void {
    const app = this._app;
    for (const spec of ACTION_COMMANDS) {
      app.commands.addCommand(spec.id, {
        label: args => this._label(spec, args),
        caption: args => this._reason(spec.action, args) || spec.label,
        isEnabled: args => !args.menu || !this._reason(spec.action, args),
        execute: args => this._run(spec.action, args)
      });
    }
    for (const move of MOVES) {
      app.commands.addCommand(move.id, {
        label: `slapo-lab: ${move.label}`,
        execute: () => {
          const view = this._view({});
          if (view) {
            view.moveCursor(move.dir);
          }
        }
      });
    }
    app.commands.addCommand(OPEN_PANEL, {
      label: args => (args.menu ? 'Open schedule editor in a panel' : 'slapo-lab: Open schedule editor in a panel'),
      caption: 'Show this editor as a panel beside the notebook (same kernel, same schedule)',
      isEnabled: args => !!this._view(args),
      execute: args => {
        const view = this._view(args);
        if (view) {
          view.sendAction('panel');
        }
      }
    });
    app.commands.addCommand(FOCUS_SEARCH, {
      label: 'slapo-lab: Search modules',
      execute: args => {
        const view = this._view(args);
        const input = view?.editorElement()?.querySelector<HTMLInputElement>('.slapo-search input');
        if (input) {
          input.focus();
          input.select();
        }
      }
    });
    app.commands.addCommand(SHORTCUTS, {
      label: 'slapo-lab: Show the keyboard shortcuts',
      execute: () => this._showShortcuts()
    });
    if (palette) {
      for (const id of [OPEN_PANEL, ...ACTION_COMMANDS.map(c => c.id), ...MOVES.map(m => m.id), FOCUS_SEARCH, SHORTCUTS]) {
        palette.addItem({ command: id, category: CATEGORY });
      }
    }
    // the output's context menu (over the editor, outside nodes and tree rows)
    app.contextMenu.addItem({ command: OPEN_PANEL, selector: '.slapo-editor', rank: 0, args: { menu: true } });

    document.addEventListener('focusin', this._onFocusIn, true);
    document.addEventListener('pointerdown', this._onFocusIn, true);
    document.addEventListener('contextmenu', this._onTreeMenu, true);
    document.addEventListener('mouseover', this._onTreeHover, true);
    setMenuHandler((view, token, x, y) => void this._openMenu(view, token, x, y));
    setPanelHandler((graph, id) => this._openPanel(graph, id));
  }

  // ------------------------------------------------------------------ which editor

  private _view(args: ReadonlyPartialJSONObject): GraphView | null {
    if (args.menu && this._menuView && liveViews.has(this._menuView)) {
      return this._menuView;
    }
    if (args.menu) {
      const hit = this._app.contextMenuHitTest(n => n.classList.contains('slapo-editor'));
      const view = viewOf(hit ?? null);
      if (view) {
        return view;
      }
    }
    const last = viewOf(this._lastEditor);
    if (last && document.contains(last.el)) {
      return last;
    }
    // the current main-area widget's editor, else any
    const current = this._app.shell.currentWidget?.node;
    for (const view of liveViews) {
      if (current && current.contains(view.el)) {
        return view;
      }
    }
    for (const view of liveViews) {
      if (view.editorElement() && document.contains(view.el)) {
        return view;
      }
    }
    return null;
  }

  private _onFocusIn = (event: Event): void => {
    const target = event.target as Element | null;
    const editor = target && typeof target.closest === 'function' ? (target.closest('.slapo-editor') as HTMLElement | null) : null;
    if (!editor) {
      return;
    }
    this._lastEditor = editor;
    if (!this._wired.has(editor)) {
      this._wired.add(editor);
      editor.addEventListener('keydown', this._onKeydown);
    }
  };

  // ------------------------------------------------------------------ keys

  private _onKeydown = (event: KeyboardEvent): void => {
    const editor = event.currentTarget as HTMLElement;
    const target = event.target as HTMLElement;
    if (!target || target.closest('.slapo-editor') !== editor || isTextField(target)) {
      return; // a nested editor handles its own; text fields type (the notebook leaves them alone)
    }
    const keystroke = CommandRegistry.keystrokeForKeydownEvent(event);
    const binding = this._app.commands.keyBindings.find(
      b => b.command.startsWith(P) && b.keys.length === 1 && b.keys[0] === keystroke && !!target.closest(b.selector)
    );
    const listbox = target instanceof HTMLSelectElement;
    const button = target instanceof HTMLButtonElement || target instanceof HTMLInputElement;
    if (!binding) {
      if (!event.ctrlKey && !event.metaKey && !event.altKey && (event.key.length === 1 || GUARDED_KEYS.has(event.key))) {
        event.stopPropagation(); // not ours, but it must not reach the notebook (x would cut the cell)
      }
      return;
    }
    event.stopPropagation();
    if ((listbox && NATIVE_LIST_KEYS.has(event.key)) || (button && (event.key === 'Enter' || event.key === ' '))) {
      return; // the tree walks its rows, a button presses itself
    }
    event.preventDefault();
    this._lastEditor = editor;
    this._keyInGraph = !!target.closest('.slapo-graph');
    void this._app.commands.execute(binding.command, { ...(binding.args || {}), key: true });
  };

  // ------------------------------------------------------------------ actions

  private _reason(action: string, args: ReadonlyPartialJSONObject): string {
    const view = this._view(args);
    const reasons = (view?.model.get('action_reasons') || {}) as { [k: string]: string };
    return typeof reasons[action] === 'string' ? reasons[action] : '';
  }

  private _label(spec: IActionCommand, args: ReadonlyPartialJSONObject): string {
    if (!args.menu) {
      return `slapo-lab: ${spec.label}`;
    }
    const view = this._view(args);
    const labels = (view?.model.get('action_labels') || {}) as { [k: string]: string };
    const base = labels[spec.action] || spec.menuLabel;
    const why = this._reason(spec.action, args);
    if (!why) {
      return base;
    }
    const short = why.length > 90 ? `${why.slice(0, 87)}…` : why;
    return `${base} — ${short}`;
  }

  private _run(action: string, args: ReadonlyPartialJSONObject): void {
    const view = this._view(args);
    if (!view) {
      return;
    }
    let node = typeof args.node === 'string' && args.node ? args.node : null;
    if (!node && action === 'open' && args.key && this._keyInGraph) {
      node = view.currentToken() || null; // Enter on the graph: the node under the keyboard cursor
    }
    view.sendAction(action, node);
  }

  // ------------------------------------------------------------------ context menus

  /** Right-click on a row of the module tree: select the row, then the menu. */
  /** A tree row's tooltip: the module's full path (the row shows only its name, indented under its parent). */
  private _onTreeHover = (event: MouseEvent): void => {
    const option = event.target as Element | null;
    if (!(option instanceof HTMLOptionElement) || option.title || !option.closest('.slapo-tree')) {
      return;
    }
    option.title = treeRowTitle(option);
  };

  private _onTreeMenu = (event: MouseEvent): void => {
    const target = event.target as Element | null;
    if (!target || typeof target.closest !== 'function' || event.shiftKey) {
      return;
    }
    const select = target.closest('.slapo-tree select') as HTMLSelectElement | null;
    const editor = select?.closest('.slapo-editor') ?? null;
    const view = viewOf(editor);
    if (!select || !view) {
      return;
    }
    event.preventDefault();
    event.stopPropagation();
    const option = target instanceof HTMLOptionElement ? target : select.selectedOptions[0];
    const { clientX, clientY } = event;
    select.focus();
    if (option && !option.selected) {
      const wait = nextReasons(view, REASONS_WAIT_MS);
      select.selectedIndex = option.index;
      select.dispatchEvent(new Event('change', { bubbles: true }));
      void wait.then(() => this._showMenu(view, null, clientX, clientY, false));
      return;
    }
    this._showMenu(view, null, clientX, clientY, false);
  };

  private async _openMenu(view: GraphView, token: string | null, x: number, y: number): Promise<void> {
    if (token && view.model.get('selected') !== token) {
      const wait = nextReasons(view, REASONS_WAIT_MS);
      view.sendAction('select', token);
      await wait;
    }
    this._showMenu(view, token, x, y, true);
  }

  private _showMenu(view: GraphView, token: string | null, x: number, y: number, onGraph: boolean): void {
    this._menuView = view;
    const menu = new Menu({ commands: this._app.commands });
    menu.addClass('slapo-context-menu');
    menu.title.label = 'slapo-lab';
    const args: ReadonlyJSONObject = token ? { menu: true, node: token } : { menu: true };
    for (const id of ['checkpoint', 'cut', 'shard', 'sync']) {
      menu.addItem({ command: `${P}${id}`, args });
    }
    menu.addItem({ type: 'separator' });
    menu.addItem({ command: `${P}open-level`, args });
    if (onGraph) {
      menu.addItem({ command: `${P}up`, args: { menu: true } });
    }
    menu.addItem({ command: `${P}select-similar`, args });
    if (!view.el.closest('.slapo-panel')) {
      menu.addItem({ type: 'separator' });
      menu.addItem({ command: OPEN_PANEL, args: { menu: true } });
    }
    menu.aboutToClose.connect(() => {
      window.setTimeout(() => {
        menu.dispose();
        if (this._menuView === view) {
          this._menuView = null;
        }
      }, 0);
    });
    menu.open(x, y);
  }

  // ------------------------------------------------------------------ shortcut list

  private async _showShortcuts(): Promise<void> {
    const commands = this._app.commands;
    const order = [...ACTION_COMMANDS.map(c => c.id), ...MOVES.map(m => m.id), FOCUS_SEARCH, SHORTCUTS];
    const rank = (id: string) => (order.indexOf(id) < 0 ? order.length : order.indexOf(id));
    const rows = commands.keyBindings
      .filter(b => b.command.startsWith(P))
      .slice()
      .sort((a, b) => rank(a.command) - rank(b.command))
      .map(b => {
        const label = commands.label(b.command, {}).replace(/^slapo-lab: /, '');
        let keys = b.keys.map(k => CommandRegistry.formatKeystroke(k)).join(', ');
        if (keys === 'Shift+/') {
          keys = '? (Shift+/)';
        }
        return `<tr><td><kbd>${escapeHtml(keys)}</kbd></td><td>${escapeHtml(label)}</td></tr>`;
      });
    const body = new Widget();
    body.addClass('slapo-shortcuts');
    body.node.innerHTML =
      '<p>While the schedule editor has focus (click the graph or the module tree). ' +
      'Change them in Settings → Keyboard Shortcuts (search "slapo-lab").</p>' +
      `<table>${rows.join('')}</table>` +
      '<p>Right-click a graph node or a tree row for its actions; each one that does not apply says why.</p>';
    await showDialog({ title: 'slapo-lab keyboard shortcuts', body, buttons: [Dialog.okButton({ label: 'Close' })] });
  }

  // ------------------------------------------------------------------ the panel

  private async _openPanel(graph: GraphModel, modelId: string): Promise<void> {
    const answer = (opened: boolean, reason: string) => graph.send({ event: 'panel', opened, reason }, {});
    const existing = this._panels.get(modelId);
    if (existing && !existing.isDisposed) {
      this._app.shell.activateById(existing.id);
      answer(true, 'The editor panel was already open; it is shown now.');
      return;
    }
    const manager = graph.widget_manager;
    const model = await manager.get_model(modelId);
    const view = await manager.create_view(model, {});
    const host = new Panel();
    host.id = `slapo-editor-panel-${modelId}`;
    host.addClass('slapo-panel-host');
    host.title.label = 'Schedule editor';
    host.title.caption = 'slapo-lab schedule editor (another view of the editor in the notebook)';
    host.title.closable = true;
    host.addWidget(view.luminoWidget);
    host.disposed.connect(() => this._panels.delete(modelId));
    this._panels.set(modelId, host);
    let ref: string | undefined;
    for (const v of liveViews) {
      const nb = v.model === graph ? v.el.closest('.jp-NotebookPanel') : null;
      if (nb && nb.id) {
        ref = nb.id;
        break;
      }
    }
    this._app.shell.add(host, 'main', { mode: 'split-right', ref: ref ?? this._app.shell.currentWidget?.id });
    this._app.shell.activateById(host.id);
    answer(true, '');
  }
}

function escapeHtml(text: string): string {
  return text.replace(/[&<>"']/g, c => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' })[c] as string);
}
