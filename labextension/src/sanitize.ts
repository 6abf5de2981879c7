/**
 * Sanitising graphviz SVG before it enters the page.
 *
 * The SVG string comes from the kernel; anything in it could run in the
 * user's browser if inserted verbatim. DOMPurify with its SVG profile keeps
 * shapes, text, ids, classes and titles and drops scripts, event-handler
 * attributes (on*), foreignObject, and javascript:/data: URLs. We also drop
 * every href (graphviz only emits them for URL/href node attributes, and a
 * graph view has no business navigating away) and `target`.
 */
import DOMPurify from 'dompurify';

const XLINK_NS = 'http://www.w3.org/1999/xlink';

/** One private DOMPurify instance, so our options never leak into others. */
let purifier: ReturnType<typeof DOMPurify> | null = null;

function getPurifier(): ReturnType<typeof DOMPurify> {
  if (purifier === null) {
    purifier = DOMPurify(window);
  }
  return purifier;
}

/**
 * Sanitise an SVG document string and return its root `<svg>` element, or
 * null when nothing displayable is left. The XML prolog and DOCTYPE that
 * graphviz emits are cut off first.
 */
export function sanitizeSvg(svgText: string): SVGSVGElement | null {
  const start = svgText.search(/<svg[\s>]/i);
  if (start < 0) {
    return null;
  }
  const fragment = getPurifier().sanitize(svgText.slice(start), {
    USE_PROFILES: { svg: true, svgFilters: true },
    FORBID_TAGS: ['script', 'style', 'foreignObject', 'iframe', 'image', 'use', 'animate', 'set'],
    FORBID_ATTR: ['href', 'xlink:href', 'target', 'style'],
    RETURN_DOM_FRAGMENT: true
  }) as DocumentFragment;
  const svg = fragment.querySelector('svg');
  if (!svg) {
    return null;
  }
  // Belt and braces: nothing active may survive, whatever the profile allows.
  svg.querySelectorAll('*').forEach(el => stripActive(el));
  stripActive(svg);
  return svg as SVGSVGElement;
}

function stripActive(el: Element): void {
  for (const attr of Array.from(el.attributes)) {
    const name = attr.name.toLowerCase();
    if (name.startsWith('on') || name === 'href' || name === 'xlink:href') {
      el.removeAttributeNode(attr);
    }
  }
  el.removeAttributeNS(XLINK_NS, 'href');
}

/**
 * The tooltip text of a graphviz node group: the `xlink:title` of its `<a>`
 * (graphviz's `tooltip` attribute), else the text of its `<title>` (the node
 * name).
 */
export function nodeTooltip(node: Element): string {
  for (const a of Array.from(node.querySelectorAll('a'))) {
    const t = a.getAttributeNS(XLINK_NS, 'title') ?? a.getAttribute('xlink:title') ?? a.getAttribute('title');
    if (t) {
      return t;
    }
  }
  const title = node.querySelector('title');
  return title?.textContent?.trim() ?? '';
}

/**
 * Remove the browser's native tooltips (`<title>` children and `xlink:title`
 * attributes) so that only our own tooltip shows.
 */
export function stripNativeTooltips(svg: Element): void {
  svg.querySelectorAll('title').forEach(t => t.remove());
  svg.querySelectorAll('a').forEach(a => {
    a.removeAttributeNS(XLINK_NS, 'title');
    a.removeAttribute('xlink:title');
    a.removeAttribute('title');
  });
}
