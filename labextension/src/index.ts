export * from './version';
export * from './widget';
export * from './sanitize';
