// common/chat.cpp, compiled here so that its private parts (the common_chat_templates
// struct, render_message_to_json / messages_inp_normalizer) can be reached. The
// static llama-common archive's own chat.cpp object is then never linked.
#include "thread_safe_time.h"
#include "chat.cpp"
#undef localtime

#include "shim.h"

namespace llamaprompt {

void templates_set_add_bos_eos(common_chat_templates * tmpls, bool add_bos, bool add_eos) {
    GGML_ASSERT(tmpls != nullptr);
    tmpls->add_bos = add_bos;
    tmpls->add_eos = add_eos;
}

const common_chat_template & templates_pick(const common_chat_templates * tmpls, bool with_tools) {
    GGML_ASSERT(tmpls != nullptr && tmpls->template_default != nullptr);
    // same choice as common_chat_templates_apply_jinja
    return with_tools && tmpls->template_tool_use ? *tmpls->template_tool_use : *tmpls->template_default;
}

json render_messages(const std::vector<common_chat_msg> & msgs, const common_chat_template & tmpl) {
    return render_message_to_json(msgs, tmpl.original_caps());
}

}  // namespace llamaprompt
