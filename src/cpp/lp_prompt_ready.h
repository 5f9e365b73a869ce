// The prompt-only stop point of llama.cpp's specialized chat handlers. adapt_tree.py
// (handler_rewrites) inserts `if (llamaprompt_prompt_ready(__func__)) { return data; }`
// into the build-tree copy of a handler's file (common/parsers/*.cpp), just before the handler
// computes its generation prompt -- only in handlers whose remaining code provably depends
// on no message and leaves the prompt as it is, and whose result is a `common_chat_params data`
// declared at its top level. Outside a prompt-only call it only records the handler's name (for
// describe()) and returns false; in one (src/cpp/shim_chat.cpp, llamaprompt_try_specialized_template)
// it returns true and marks the call stopped: the handler returns its params at once, and the
// caller takes their prompt.
// The autoparser's generate_parser (common/chat-auto-parser-generator.cpp) gets the same call,
// with a null name, just before it builds its parser (adapt_tree.py generator_rewrite): the
// prompt-only path of requests that continue the final message or turn add_generation_prompt off.
#pragma once

#include <string>

bool llamaprompt_prompt_ready(const char * handler);

// The same stop point in a handler whose prompt ends with a fix-up block after the generation
// prompt (adapt_tree.py _prompt_fixup: gemma4 appends the model's turn opener to a prompt that
// ends a turn). The build-tree copy puts, just before the generation prompt's line,
//   if (llamaprompt_prompt_stop_armed(__func__)) { <a copy of the block> llamaprompt_prompt_stop(); return data; }
// llamaprompt_prompt_stop_armed records the handler's name as llamaprompt_prompt_ready does and
// says whether this call stops at the prompt; llamaprompt_prompt_stop then marks the call stopped
// (the block's copy never runs on the full path).
bool llamaprompt_prompt_stop_armed(const char * handler);
void llamaprompt_prompt_stop();

// The stop point of a handler whose code after the prompt reads the generation prompt too
// (adapt_tree.py PROMPT_READY_AFTER: ling3 and minimax-m3 look for an unclosed think tag in it),
// put right after the generation prompt's statement when that is its render alone, as
// `if (llamaprompt_prompt_ready_after(...)) { return data; }`. In a prompt-only call it returns
// true (the handler returns, its prompt taken) once these non-message inputs *and this generation
// prompt* produced the handler's params without error; otherwise it records that key, added to the
// memo when the handler finishes (src/cpp/shim_chat.cpp), and returns false.
bool llamaprompt_prompt_ready_after(const std::string & generation_prompt, const char * handler);

// The prompt's render handed to the generation prompt (adapt_tree.py no_gen_reuse_edits, an
// engine rewrite): declared right after `data.prompt = <render>(ARGS);` where the next statement
// is `data.generation_prompt = <generation prompt>(ARGS);` with the same arguments. The next
// common_chat_template_generation_prompt_impl on this thread, for the same inputs object, takes
// `prompt` as its render without add_generation_prompt (a request without it) or as its render
// with it (a request with it) -- the same call's result (src/cpp/shim_chat.cpp,
// llamaprompt_reuse_render) -- instead of rendering the template again.
class llamaprompt_rendered_prompt {
  public:
    llamaprompt_rendered_prompt(const std::string & prompt, const void * inputs);
    ~llamaprompt_rendered_prompt();
    llamaprompt_rendered_prompt(const llamaprompt_rendered_prompt &) = delete;
    llamaprompt_rendered_prompt & operator=(const llamaprompt_rendered_prompt &) = delete;

  private:
    const std::string * prev_prompt_;
    const void * prev_inputs_;
};
